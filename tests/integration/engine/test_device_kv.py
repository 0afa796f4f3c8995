"""The whole-buffer (opaque device KV) path on the CPU EP, standing in for WebGPU: decode in batch buckets over a
prefix of the KV rows, chunked prefill through a staging row, device row copies (Gather + ScatterND in place).

The CPU EP runs the same graphs and the same runner code as the WebGPU EP (only the binding of a KV prefix
differs: a numpy view here, the buffer's address there; tests/integration/ep/test_webgpu_engine.py runs the
device). Every comparison is against the row-view engine, token for token up to a near-tie (greedy, float32 tiny
model: the two batch their rows differently, tests/greedy_close.py).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.device_kv import RowCopier, batch_buckets, bucket_for, row_copy_graph_bytes
from engine.types import SamplingParams
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close

GREEDY = dict(temperature=0.0, ignore_eos=True)
GREEDY_TOP = dict(GREEDY, logprobs=True, top_logprobs=TOP_K)  # with each step's top-k (tests/greedy_close.py)


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str) -> list:
    return [out async for out in engine.generate(prompt, params, rid)]


def _tokens(outputs: list, index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.token_ids]


def _assert_close(ref: list, got: list, what: str = "", got_index: int = 0) -> None:
    """Choice ``got_index`` of ``got`` equals ``ref`` up to a near-tie of the tiny model (both with GREEDY_TOP)."""
    assert_greedy_close(GreedyRun.from_engine(ref), GreedyRun.from_engine(got, got_index), TINY_MAX_GAP_NATS, what)


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + 3 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def pair(tiny_model: Path):
    """(row-view engine, whole-buffer engine) over the same folder, 8 slots, prefill chunks of 16."""
    config = dict(max_batch=8, prefill_chunk=16, speculative_tokens=0)
    rows = AsyncEngine.from_model_dir(tiny_model, EngineConfig(**config))
    whole = AsyncEngine.from_model_dir(tiny_model, EngineConfig(kv_rows="opaque", **config))
    yield rows, whole
    rows.shutdown()
    whole.shutdown()


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert [bucket_for((1, 2, 4, 8), n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


def test_row_copier_copies_one_row_in_place_and_nothing_else():
    shape = (4, 2, 8, 3)
    session = ort.InferenceSession(row_copy_graph_bytes(2, np.float32, shape[1], shape[2]),
                                   providers=["CPUExecutionProvider"])
    copier = RowCopier(session, 2)
    rng = np.random.default_rng(0)
    big = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    stage = [rng.standard_normal((1, *shape[1:])).astype(np.float32) for _ in range(2)]
    big_before, stage_before = [b.copy() for b in big], [s.copy() for s in stage]
    big_values = [ort.OrtValue.ortvalue_from_numpy(b) for b in big]  # zero copy: the copy lands in `big`
    stage_values = [ort.OrtValue.ortvalue_from_numpy(s) for s in stage]

    copier.copy(stage_values, 0, big_values, 2)  # staging row -> slot 2
    for b, before, s in zip(big, big_before, stage_before):
        np.testing.assert_array_equal(b[2], s[0])
        np.testing.assert_array_equal(np.delete(b, 2, axis=0), np.delete(before, 2, axis=0))
    copier.copy(big_values, 3, stage_values, 0)  # slot 3 -> staging row
    copier.copy(big_values, 0, big_values, 1)  # slot 0 -> slot 1 in the same buffers
    for b, before, s in zip(big, big_before, stage):
        np.testing.assert_array_equal(s[0], before[3])
        np.testing.assert_array_equal(b[1], before[0])
        np.testing.assert_array_equal(b[0], before[0])
        np.testing.assert_array_equal(b[3], before[3])
    assert copier.num_copies == 3


def test_opaque_kv_path_on_cpu_gives_the_row_view_tokens_with_staggered_arrivals(pair):
    """Five requests (40-52 prompt tokens: 3-4 chunks each) arriving one by one while others decode: the
    decode width moves between buckets, prompts go through the staging row, and every token equals the
    row-view engine's."""
    rows, whole = pair
    ps = _prompts(rows.vocab_size, 5, 40, seed=3)
    params = SamplingParams(max_tokens=12, **GREEDY_TOP)

    async def staggered(engine: AsyncEngine, tag: str):
        tasks = []
        for i, p in enumerate(ps):
            tasks.append(asyncio.create_task(_collect(engine, p, params, f"{tag}{i}")))
            await asyncio.sleep(0)  # NOTE(test): order only; the result must not depend on the interleaving
        return await asyncio.gather(*tasks)

    expected = asyncio.run(staggered(rows, "r"))
    runner = whole._core.runner  # test only: the core's runner
    copies_before = runner.copier.num_copies
    got = asyncio.run(staggered(whole, "w"))
    # NOTE(tests): decode buckets run idle rows beside the live ones, the row-view engine only the live range
    for i, (ref, out) in enumerate(zip(expected, got)):
        _assert_close(ref, out, f"request {i}")
    assert runner.buckets == (1, 2, 4, 8)
    # staged chunks are runs of their own: one request's per step (the row-view engine: as the budget holds)
    assert whole._core.scheduler.max_prefills == 1 and rows._core.scheduler.max_prefills == rows.config.max_batch
    assert runner.copier.num_copies - copies_before >= sum(-(-len(p) // 16) for p in ps)  # one per chunk at least


def test_opaque_kv_path_on_cpu_one_stream_decodes_in_the_smallest_bucket(pair):
    """Requests one after another take slot 0 whatever slot 0 cached (low slots), so one stream decodes at
    width 1; a prefix cached elsewhere is copied over on the device."""
    _, whole = pair
    runner = whole._core.runner
    ps = _prompts(whole.vocab_size, 3, 30, seed=9)
    params = SamplingParams(max_tokens=6, **GREEDY)
    widths = []
    original = runner._run_decode

    def spy(binding, width, *args):
        widths.append(width)
        return original(binding, width, *args)

    runner._run_decode = spy
    try:
        for i, p in enumerate(ps):
            asyncio.run(_collect(whole, p, params, f"one{i}"))
    finally:
        del runner._run_decode
    assert widths and set(widths) == {1}


def test_opaque_kv_path_on_cpu_reuses_a_prefix_and_n_choices_share_the_prompt(pair):
    rows, whole = pair
    base = _prompts(rows.vocab_size, 1, 50, seed=21)[0]
    follow = base + [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=8, **GREEDY_TOP)
    cold = asyncio.run(_collect(rows, follow, params, "cold"))
    asyncio.run(_collect(whole, base, params, "first"))
    # another prompt takes slot 0 in between: base's KV is saved to a free slot, copied back into slot 0 for
    # the follow-up, and the staging row (which holds the other prompt's KV) takes it in before the rest
    asyncio.run(_collect(whole, _prompts(rows.vocab_size, 1, 45, seed=22)[0], params, "between"))
    second = asyncio.run(_collect(whole, follow, params, "second"))
    _assert_close(cold, second, "a reused prefix against cold")
    assert second[-1].num_cached_tokens >= len(base) - 2
    choices = asyncio.run(_collect(whole, follow, SamplingParams(max_tokens=8, n=3, **GREEDY_TOP), "n3"))
    for i in range(3):  # a batch of three against one row alone
        _assert_close(cold, choices, f"choice {i} against cold", got_index=i)
        assert _tokens(choices, i) == _tokens(choices, 0)  # NOTE(tests): exact: rows of the same runs
