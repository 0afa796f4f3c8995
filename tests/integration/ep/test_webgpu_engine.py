"""The engine on the WebGPU plugin EP: same device selection as AMDGPU, KV in device memory, fallback decode
inputs, CPU logits, greedy output equal to the CPU EP's (near-ties detected and reported), graph capture.

The device tests run on the GPU machine only (ORTSERVE_DEVICE_TESTS=1, onnxruntime-ep-webgpu, a Vulkan GPU);
what they saw lands in webgpu_engine.json under $OUT (or the test's tmp dir). The CPU tests check the
captured-step machinery (the rewritten graph, fixed input/output buffers) against the plain path everywhere.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.graph_capture import PACKED_INPUT, capture_graph_bytes, open_session
from engine.kv_cache import HostKVAllocator, KVCache, KVShape
from engine.model_loader import check_graph, create_session, read_model_folder
from engine.bucket_runner import BucketRunner, DecodePath
from engine.types import ModelLoadError, SamplingParams

NUM_TOKENS = 64
NEAR_TIE = 0.1  # nats: fp16 kernels on two EPs may swap tokens whose logits are closer than this
PROMPTS = [[1, 17, 942, 301, 55, 7], [1, 400, 12], [1, 222, 1000, 99, 3, 3, 871, 16, 204]]
GREEDY = dict(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)


@pytest.fixture(scope="module")
def int4_fp16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic INT4 model with float16 activations and KV (the GPU build), head size 64 as in real models.

    NOTE(test): this shape (untied LM head) keeps greedy output varied (~35 distinct tokens in 64 on the CPU
    EP); larger random models collapse onto one or two tokens, which would make the comparison vacuous.
    """
    from engine.builder import SyntheticSpec, build_synthetic

    spec = SyntheticSpec(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                         vocab_size=1024, max_length=256, quant="int4", dtype="float16", seed=3,
                         tie_word_embeddings=False)
    return build_synthetic(tmp_path_factory.mktemp("webgpu_engine") / "int4_fp16", spec)


@pytest.fixture(scope="module")
def findings(tmp_path_factory: pytest.TempPathFactory):
    data: dict = {}
    yield data
    out = Path(os.environ.get("OUT") or tmp_path_factory.mktemp("webgpu_engine_out"))
    (out / "webgpu_engine.json").write_text(json.dumps(data, indent=2, default=str))


async def _greedy(engine: AsyncEngine, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    """Greedy NUM_TOKENS for every prompt, all submitted together: (token ids, per-token logprobs)."""
    async def one(i: int, prompt: list[int]):
        ids, lps = [], []
        async for out in engine.generate(prompt, SamplingParams(**GREEDY), f"r{i}"):
            ids += out.token_ids
            lps += list(out.logprobs or ())
        return ids, lps
    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def _compare(ref: tuple[list[int], list], got: tuple[list[int], list]) -> dict:
    """Token-by-token comparison; at the first divergence, is it a near-tie of the reference's top two?"""
    ref_ids, ref_lps = ref
    got_ids, _ = got
    first = next((i for i, (a, b) in enumerate(zip(ref_ids, got_ids)) if a != b), None)
    result = {"equal_prefix": len(ref_ids) if first is None else first, "num_tokens": len(ref_ids)}
    if first is not None:
        top = dict(ref_lps[first].top)  # the reference's two best at that step: token -> logprob
        gap = top[ref_ids[first]] - top[got_ids[first]] if got_ids[first] in top else float("inf")
        result.update(first_divergence=first, ref_token=ref_ids[first], got_token=got_ids[first],
                      ref_top2_gap=gap, near_tie=bool(gap < NEAR_TIE))
    return result


@pytest.fixture(scope="module")
def cpu_reference(int4_fp16_model):
    engine = AsyncEngine.from_model_dir(int4_fp16_model, EngineConfig(provider="cpu", max_batch=4, seed=0))
    try:
        return asyncio.run(_greedy(engine, PROMPTS))
    finally:
        engine.shutdown()


# --- on the GPU ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def webgpu_device():
    from ep import device
    from ep.names import DeviceNotFoundError

    try:
        return device.select_device("webgpu")
    except DeviceNotFoundError as e:
        pytest.skip(f"no WebGPU EP device here: {e}")


@pytest.mark.device
@pytest.mark.parametrize("graph_capture", [False, None], ids=["no_capture", "auto_capture"])
def test_webgpu_engine_places_and_matches_cpu(webgpu_device, int4_fp16_model, cpu_reference, findings,
                                              graph_capture) -> None:
    engine = AsyncEngine.from_model_dir(int4_fp16_model, EngineConfig(provider="webgpu", max_batch=4, seed=0,
                                                                       graph_capture=graph_capture,
                                                                       engine_process=False))  # reads the runner
    try:
        placement = engine.placement
        runner = engine._core.runner
        kv_device = runner.kv.keys[0].device_name()
        got = asyncio.run(_greedy(engine, PROMPTS))
        single = asyncio.run(_greedy(engine, PROMPTS[:1]))[0]  # the same prompt alone (rows independent)
    finally:
        engine.shutdown()
    comparisons = [_compare(r, g) for r, g in zip(cpu_reference, got)]
    findings[f"engine_{'capture_' + str(graph_capture)}"] = {
        "placement": placement, "kv_device": kv_device, "comparisons": comparisons,
        "batched_equals_single": got[0][0] == single[0]}
    # Discovered, filtered and selected by ep/ as for AMDGPU: the device id is the DEFAULT memory info's.
    assert placement.provider == "webgpu" and placement.ep_name == "WebGpuExecutionProvider"
    assert placement.device_id == int(webgpu_device.default_memory.device_id)
    assert placement.kv_cache == "device" and kv_device == "webgpu" and placement.whole_buffer
    # No HOST_ACCESSIBLE memory on WebGPU: the decode inputs are ordinary CPU buffers (uploaded by ORT,
    # or by the engine into fixed device buffers when the step is captured); logits always reach the CPU.
    assert webgpu_device.host_accessible_memory is None
    if graph_capture is None:
        assert placement.graph_capture, placement.graph_capture_note  # auto: on where the graph allows
        assert placement.decode_inputs == "cpu->device" and placement.logits == "device->cpu"
    else:
        assert not placement.graph_capture
        assert placement.decode_inputs == "cpu" and placement.logits == "cpu"
    assert len(set(cpu_reference[0][0])) >= 10  # the reference is varied: the comparison means something
    # NOTE(test): the prompt alone decodes at width 1, beside the others at width 4 (batch buckets): MatMulNBits
    # rounds M = 1 and M = 4 differently, so the two agree up to the first near-tie, not bit for bit
    alone = _compare(got[0], single)
    assert alone["equal_prefix"] == NUM_TOKENS or alone["near_tie"] or alone.get("ref_top2_gap", 1) < NEAR_TIE, alone
    mismatches = [c for c in comparisons if not (c["equal_prefix"] == NUM_TOKENS or c["near_tie"])]
    # NOTE(test): issue 13 saw the uncaptured runs differ and marked them xfail; the cause was the runner's stale
    # host inputs (engine.runner.RunnerBase._run), fixed in issue 22: both must match now.
    assert not mismatches, mismatches


LONG_NEAR_TIE = 0.25  # nats, for prompts of 45-100 tokens (see the test)
LONG_PROMPTS = [[1] + [(37 * i + 11 * k) % 1000 + 3 for i in range(n)] for k, n in enumerate((100, 70, 45))]


@pytest.mark.device
def test_webgpu_chunked_prefill_buckets_and_prefix_copies_match_cpu(webgpu_device, int4_fp16_model, findings) -> None:
    """Prompts of 45-100 tokens in chunks of 32 through the staging row, decoded together in batch buckets
    over a prefix of the device KV, then a follow-up that reuses a prompt by a device row copy: the tokens
    equal the CPU EP's (up to near-ties), and one stream decodes at width 1."""
    config = dict(max_batch=8, prefill_chunk=32, seed=0)
    follow = LONG_PROMPTS[0] + [7, 8, 9, 10]
    cpu = AsyncEngine.from_model_dir(int4_fp16_model, EngineConfig(provider="cpu", **config))
    try:
        ref = asyncio.run(_greedy(cpu, LONG_PROMPTS))
        ref_follow = asyncio.run(_greedy(cpu, [follow]))[0]
    finally:
        cpu.shutdown()
    engine = AsyncEngine.from_model_dir(int4_fp16_model, EngineConfig(provider="webgpu", **config,
                                                                       engine_process=False))  # reads the runner
    try:
        runner = engine._core.runner
        widths = []
        original = runner._run_decode
        runner._run_decode = lambda binding, width, *rest: (widths.append(width), original(binding, width, *rest))[1]
        got = asyncio.run(_greedy(engine, LONG_PROMPTS))
        together = set(widths)
        widths.clear()
        got_follow = asyncio.run(_greedy(engine, [follow]))[0]
        alone = set(widths)
        stats = engine.stats()
        placement = engine.placement
    finally:
        engine.shutdown()
    comparisons = [_compare(r, g) for r, g in zip([*ref, ref_follow], [*got, got_follow])]
    findings["chunked_prefill_buckets"] = {"placement": placement, "comparisons": comparisons,
                                           "widths_together": sorted(together), "widths_alone": sorted(alone),
                                           "copies": runner.copier.num_copies, "stats_extra": stats.extra}
    assert placement.graph_capture and runner.buckets == (1, 2, 4, 8) and runner.staging is not None
    assert together <= {4, 2, 1} and 4 in together and alone == {1}
    assert runner.copier.num_copies >= 4 + 3 + 2 + 1  # a copy per chunk, plus the follow-up's prefix copy
    # NOTE(test): a 100-token prompt goes through WebGPU's fp16 prefill kernel in one run, and the CPU EP's in its
    # own order: measured on the H200, the 100-token prompt diverged at token 8 with the CPU's top two 0.13 nats
    # apart (the others below 0.016), so near-ties here are those under LONG_NEAR_TIE. A KV landing in the wrong
    # row or position would diverge at once by whole nats.
    mismatches = [c for c in comparisons
                  if not (c["equal_prefix"] == NUM_TOKENS or c.get("ref_top2_gap", 0.0) < LONG_NEAR_TIE)]
    assert not mismatches, mismatches
    assert min(c["equal_prefix"] for c in comparisons) >= 4


@pytest.mark.device
def test_graph_capture_required_is_honoured(webgpu_device, int4_fp16_model, findings) -> None:
    opened = open_session(read_model_folder(int4_fp16_model),
                          EngineConfig(provider="webgpu", max_batch=2, graph_capture=True), 256)
    assert opened.graph_capture and opened.session._sess.is_webgpu_graph_capture_enabled()
    findings["graph_capture_required"] = opened.note


# --- everywhere (CPU) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["three_inputs", "packed_input"])
def test_captured_step_machinery_equals_the_plain_path_on_cpu(tiny_model, packed) -> None:
    """The rewritten graph (constant total length, frozen defaults, no shape ops; optionally one packed
    input) with fixed input/logits buffers, uploads and binding readback gives the plain whole-buffer path's
    logits, idle rows included."""
    import onnx

    folder = read_model_folder(tiny_model)
    config = EngineConfig(max_batch=3, prefill_chunk=16)
    graph = capture_graph_bytes(folder, 64, packed=packed)
    plain, _ = create_session(folder, config)
    rewritten, _ = create_session(folder, config, model_bytes=graph)
    proto = onnx.load_from_string(graph)
    assert "Shape" not in {n.op_type for n in proto.graph.node}  # the total length is no shape computation
    inputs = {i.name for i in proto.graph.input}
    assert (PACKED_INPUT in inputs) is packed and ("attention_mask" in inputs) is not packed
    packed_input = PACKED_INPUT if packed else None

    def runner(session, device_alloc=None, packed_input=None):
        io = check_graph(folder, session, packed_input=packed_input)
        kv = KVCache(KVShape(folder.num_layers, 3, folder.num_kv_heads, 64, folder.head_size, io.kv_dtype),
                     HostKVAllocator())
        return BucketRunner(session, io, kv, prefill_chunk=16, max_position=64,
                            decode=DecodePath(device_alloc=device_alloc, packed_input=packed_input))

    def cpu_alloc(shape, dtype):
        import onnxruntime as ort
        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=dtype))

    a, b = runner(plain), runner(rewritten, cpu_alloc, packed_input)
    assert b.device_io is not None and b.input_source == "cpu->device"
    b.warmup()
    for r in (a, b):
        r.prefill(0, [5, 6, 7, 8], 0)
        r.prefill(2, [9, 10], 0)
    steps = [([0, 2], [11, 12], [4, 2]), ([2], [13], [3]), ([0, 1, 2], [14, 15, 16], [5, 0, 4])]
    for slots, ids, pos in steps:
        np.testing.assert_allclose(b.decode(slots, ids, pos), a.decode(slots, ids, pos), rtol=1e-5, atol=1e-5)


def test_graph_capture_required_on_cpu_is_a_load_error(tiny_model) -> None:
    with pytest.raises(ModelLoadError, match="graph_capture=True needs the WebGPU or CUDA EP"):
        AsyncEngine.from_model_dir(tiny_model, EngineConfig(provider="cpu", graph_capture=True))
