"""The engine takes the host-accessible path for its decode inputs, and its greedy output equals plain CPU.

Two devices offer HOST_ACCESSIBLE memory here: the OpenVINO plugin EP's CPU device (real, on Intel CPUs
only: the plugin creates no device on other vendors' CPUs, where that test skips), and a CPU memory info
of type HOST_ACCESSIBLE with an allocator registered in ORT's environment. The second stands in for the
AMDGPU EP's host-accessible heap: same ORT calls (ortvalue_from_shape_and_type(memory_info=...)), same
runner code, and the CPU writes the inputs in place with no per-step copy.
"""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_cache import HostKVAllocator, KVCache, KVShape
from engine.model_loader import check_graph, create_session, read_model_folder
from engine.runner import Runner, make_input_allocator
from engine.types import SamplingParams
from ep.device import DeviceRecord, SelectedDevice, select_device
from ep.host_memory import SOURCE_EP
from ep.names import DeviceNotFoundError
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close

STEPS = 24


def _stand_in_device() -> SelectedDevice:
    mem = ort.OrtMemoryInfo.create_v2("Cpu", ort.OrtMemoryInfoDeviceType.CPU, 0, 0,
                                      ort.OrtDeviceMemoryType.HOST_ACCESSIBLE, 0,
                                      ort.OrtAllocatorType.ORT_DEVICE_ALLOCATOR)
    try:
        ort.create_and_register_allocator(mem, None)
    except Exception:  # noqa: BLE001 - already registered by another test in this process
        pass
    record = DeviceRecord(index=0, ep_name="CPUExecutionProvider", host_accessible_device_id=0,
                          host_accessible_memory_name=mem.name)
    return SelectedDevice("cpu", "CPUExecutionProvider", None, 0, None, mem, record)


@pytest.fixture(scope="module")
def model(tiny_model):
    folder = read_model_folder(tiny_model)
    session, _ = create_session(folder, EngineConfig(max_batch=4, prefill_chunk=16))
    return folder, session, check_graph(folder, session)


def _greedy(runner: Runner, slots: list[int], prompts: list[list[int]]) -> list[list[int]]:
    """Prefill each prompt into its slot, then decode all slots together for STEPS tokens."""
    out = []
    for slot, prompt in zip(slots, prompts):
        out.append([int(np.argmax(runner.prefill(slot, prompt, 0)))])
    for i in range(STEPS - 1):
        logits = runner.decode(slots, [o[-1] for o in out], [len(p) + i for p in prompts])
        for o, row in zip(out, logits):
            o.append(int(np.argmax(row)))
    return out


def _runner(model, input_allocator) -> Runner:
    folder, session, io = model
    kv = KVCache(KVShape(folder.num_layers, 4, folder.num_kv_heads, 128, folder.head_size, io.kv_dtype),
                 HostKVAllocator())
    kwargs = {} if input_allocator is None else {"input_allocator": input_allocator}
    return Runner(session, io, kv, prefill_chunk=16, max_position=128, **kwargs)


def test_runner_decode_inputs_in_host_accessible_memory_stands_in_for_amd(model) -> None:
    allocator = make_input_allocator(_stand_in_device())
    runner = _runner(model, allocator)
    assert runner.input_source == SOURCE_EP  # the path taken, as the engine logs it
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 500, n).tolist() for n in (9, 14, 5)]
    plain = _greedy(_runner(model, None), [0, 1, 3], prompts)
    assert _greedy(runner, [0, 1, 3], prompts) == plain  # NOTE(tests): exact: one session, the same rows


async def _generate(engine: AsyncEngine, prompt: list[int]) -> GreedyRun:
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)
    return GreedyRun.from_engine([out async for out in engine.generate(prompt, params, "r")])


def test_engine_on_openvino_takes_the_host_accessible_path(tiny_model) -> None:
    try:
        select_device("openvino")
    except DeviceNotFoundError as e:
        pytest.skip(f"no OpenVINO EP device on this machine (the plugin serves Intel CPUs only): {e}")
    prompt = list(range(5, 40))
    cpu = AsyncEngine.from_model_dir(tiny_model, EngineConfig(provider="cpu", max_batch=2))
    try:
        expected = asyncio.run(_generate(cpu, prompt))
    finally:
        cpu.shutdown()
    ov = AsyncEngine.from_model_dir(tiny_model, EngineConfig(provider="openvino", max_batch=2))
    try:
        assert ov.placement.decode_inputs == SOURCE_EP
        # NOTE(tests): OpenVINO's kernels against ONNX Runtime's own: equal up to a near-tie (tests/greedy_close.py)
        got = asyncio.run(_generate(ov, prompt))
        assert len(got.tokens) == STEPS
        assert_greedy_close(expected, got, TINY_MAX_GAP_NATS, "OpenVINO against the CPU EP")
    finally:
        ov.shutdown()
