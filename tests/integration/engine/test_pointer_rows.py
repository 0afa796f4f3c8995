"""KV rows bound by address on the CPU EP, standing in for CUDA and HIP device memory (issue 22).

``kv_rows="pointer"`` puts the KV cache in host memory but binds it exactly as pointer-addressed device memory is
bound: a row is the buffer's address plus ``row * row_bytes`` given to IOBinding, and copies between slots run on
the "device" through the Identity-graph copier (``engine.device_kv.AddressRowCopier``). The CUDA EP runs the
same code (tests/integration/ep/test_cuda_engine.py); AMD hardware can't be here, so these stand in for it.
Every comparison is against the row-view engine (numpy views): token for token or bit for bit where both run the
same row counts, up to a near-tie (tests/greedy_close.py) where batching may differ.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.device_kv import AddressRowCopier, address_copy_graph_bytes
from engine.kv_cache import POINTER, HostKVAllocator, KVCache, KVShape
from engine.model_loader import check_graph, create_session, read_model_folder
from engine.row_chunks import chunk_pieces, chunk_shapes
from engine.runner import Runner
from engine.types import SamplingParams

from tests.integration.engine.test_device_kv import GREEDY, GREEDY_TOP, _assert_close, _collect, _prompts, _tokens


@pytest.fixture(scope="module")
def pair(tiny_model: Path):
    """(row-view engine, rows-by-address engine) over the same folder, 8 slots, prefill chunks of 16."""
    config = dict(max_batch=8, prefill_chunk=16, speculative_tokens=0)
    views = AsyncEngine.from_model_dir(tiny_model, EngineConfig(**config))
    pointer = AsyncEngine.from_model_dir(tiny_model, EngineConfig(kv_rows="pointer", **config))
    yield views, pointer
    views.shutdown()
    pointer.shutdown()


def test_rows_by_address_stand_in_for_cuda_and_hip_give_the_row_view_tokens(pair):
    """Five requests of 40-52 prompt tokens arriving while others decode (chunked prefill straight into each
    slot's row, decode over the running rows only): every token equals the numpy-view engine's."""
    views, pointer = pair
    assert pointer.placement.kv_rows == "pointer" and pointer.placement.runner == "rows (pointer)"
    assert not pointer.placement.whole_buffer and views.placement.kv_rows == "host"
    ps = _prompts(views.vocab_size, 5, 40, seed=3)
    params = SamplingParams(max_tokens=12, **GREEDY_TOP)

    async def staggered(engine: AsyncEngine, tag: str):
        tasks = []
        for i, p in enumerate(ps):
            tasks.append(asyncio.create_task(_collect(engine, p, params, f"{tag}{i}")))
            await asyncio.sleep(0)  # NOTE(test): order only; the result must not depend on the interleaving
        return await asyncio.gather(*tasks)

    got, expected = asyncio.run(staggered(pointer, "p")), asyncio.run(staggered(views, "v"))
    # NOTE(tests): the interleaving (so which rows decode together) may differ between the two runs
    for i, (ref, out) in enumerate(zip(expected, got)):
        _assert_close(ref, out, f"request {i}")


def test_rows_by_address_stand_in_for_cuda_and_hip_copy_a_prefix_and_n_choices(pair):
    """Prefix reuse from another slot and n > 1 copy rows on the "device" (the address copier), and give the
    cold run's tokens."""
    views, pointer = pair
    base = _prompts(views.vocab_size, 1, 50, seed=21)[0]
    follow = base + [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=8, **GREEDY_TOP)
    cold = asyncio.run(_collect(views, follow, params, "cold"))
    copier = pointer._core.runner.kv.row_copy  # test only: the core's runner
    assert isinstance(copier, AddressRowCopier)
    asyncio.run(_collect(pointer, base, params, "first"))
    # a long prompt in between takes base's slot or another; either way the follow-up finds base's prefix
    asyncio.run(_collect(pointer, _prompts(views.vocab_size, 1, 45, seed=22)[0], params, "between"))
    before = copier.num_copies
    second = asyncio.run(_collect(pointer, follow, params, "second"))
    _assert_close(cold, second, "a reused prefix against cold")
    assert second[-1].num_cached_tokens >= len(base) - 2
    choices = asyncio.run(_collect(pointer, follow, SamplingParams(max_tokens=8, n=3, **GREEDY_TOP), "n3"))
    for i in range(3):  # a batch of three against one row alone
        _assert_close(cold, choices, f"choice {i} against cold", got_index=i)
        assert _tokens(choices, i) == _tokens(choices, 0)  # NOTE(tests): exact: rows of the same runs
    assert copier.num_copies - before >= 2  # the choices' rows got the prompt by device copies


@pytest.fixture(scope="module")
def model(tiny_model: Path):
    folder = read_model_folder(tiny_model)
    session, _ = create_session(folder, EngineConfig(max_batch=4, prefill_chunk=16))
    return folder, session, check_graph(folder, session)


def _cpu_alloc(shape, dtype):
    """The fixed-buffer runner's "device" allocator on the CPU EP: zeroed host OrtValues."""
    return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=dtype))


def _runner(model, slots: int, addressing: str) -> Runner:
    folder, session, io = model
    kv = KVCache(KVShape(folder.num_layers, slots, folder.num_kv_heads, 96, folder.head_size, io.kv_dtype),
                 HostKVAllocator(addressing))
    return Runner(session, io, kv, prefill_chunk=16, max_position=96)


def _greedy(runner: Runner, slot: int, prompt: list[int], steps: int) -> list[int]:
    logits = None
    for start in range(0, len(prompt), 16):
        logits = runner.prefill(slot, prompt[start:start + 16], start)
    out = [int(np.argmax(logits))]
    for i in range(steps - 1):
        out.append(int(np.argmax(runner.decode([slot], [out[-1]], [len(prompt) + i])[0])))
    return out


def test_a_request_in_row_2_of_a_shared_buffer_leaves_the_kv_of_one_alone_stands_in_for_cuda(model):
    """Row 2 of a [4, H, L, D] buffer per layer, bound by address (past and present the same memory), ends with
    layer 0's KV bit-identical to the same request on [1, H, L, D] buffers of its own; rows 0, 1 and 3 keep
    what they held."""
    prompt = np.random.default_rng(5).integers(3, 500, 37).tolist()
    shared, alone = _runner(model, 4, POINTER), _runner(model, 1, POINTER)
    rng = np.random.default_rng(6)
    for kv in (shared.kv,):
        for a in [kv.key_array(i) for i in range(kv.shape.num_layers)] + \
                 [kv.value_array(i) for i in range(kv.shape.num_layers)]:
            a[...] = rng.standard_normal(a.shape)  # other rows hold something to lose
    before = [shared.kv.key_array(0).copy(), shared.kv.value_array(0).copy()]
    tokens = _greedy(shared, 2, prompt, 10)
    # NOTE(tests): exact, bit for bit: both run the same row counts (16-token chunks, then one row alone)
    assert tokens == _greedy(alone, 0, prompt, 10)
    n = len(prompt) + 9
    for got, solo, old in ((shared.kv.key_array(0), alone.kv.key_array(0), before[0]),
                           (shared.kv.value_array(0), alone.kv.value_array(0), before[1])):
        np.testing.assert_array_equal(got[2, :, :n], solo[0, :, :n])
        np.testing.assert_array_equal(np.delete(got, 2, axis=0), np.delete(old, 2, axis=0))


def test_the_address_copier_copies_one_row_of_every_buffer_and_nothing_else(model):
    folder, _, io = model
    kv = KVCache(KVShape(folder.num_layers, 4, folder.num_kv_heads, 32, folder.head_size, io.kv_dtype),
                 HostKVAllocator(POINTER))
    s = kv.shape
    graph = address_copy_graph_bytes(len(kv.buffers), s.dtype, (1, s.num_kv_heads, s.length, s.head_size))
    copier = AddressRowCopier(ort.InferenceSession(graph, providers=["CPUExecutionProvider"]), kv)
    arrays = [kv.key_array(i) for i in range(s.num_layers)] + [kv.value_array(i) for i in range(s.num_layers)]
    rng = np.random.default_rng(0)
    for a in arrays:
        a[...] = rng.standard_normal(a.shape)
    before = [a.copy() for a in arrays]
    copier(3, 1)
    copier(0, 2)
    for a, old in zip(arrays, before):
        np.testing.assert_array_equal(a[1], old[3])
        np.testing.assert_array_equal(a[2], old[0])
        np.testing.assert_array_equal(a[[0, 3]], old[[0, 3]])
    assert copier.num_copies == 2


def test_bucketed_fixed_buffer_steps_over_rows_by_address_stand_in_for_cuda_and_hip_graphs(model):
    """The discipline captured device graphs need (CUDA graphs, the AMDGPU EP's HIP graphs): decode steps over
    rows [0, b) of each bucket, bound once to fixed input and logits buffers (uploaded and read back each step),
    prompt chunks straight into the rows by address. Two requests decoded together give the row-view tokens."""
    from engine.bucket_runner import BucketRunner, DecodePath, RowPrompts

    folder, session, io = model

    kv = KVCache(KVShape(folder.num_layers, 4, folder.num_kv_heads, 96, folder.head_size, io.kv_dtype),
                 HostKVAllocator(POINTER))
    fixed = BucketRunner(session, io, kv, prefill_chunk=16, max_position=96, decode=DecodePath(device_alloc=_cpu_alloc),
                         prompts=RowPrompts())
    assert fixed.buckets == (1, 2, 4) and fixed.can_verify and fixed.device_io is not None
    views = _runner(model, 4, "host")
    prompts = [np.random.default_rng(s).integers(3, 500, n).tolist() for s, n in ((7, 29), (8, 18))]

    def together(r) -> list[list[int]]:
        firsts = []
        for slot, p in enumerate(prompts):
            for start in range(0, len(p), 16):
                logits = r.prefill(slot, p[start:start + 16], start)
            firsts.append([int(np.argmax(logits))])
        for i in range(8):
            logits = r.decode([0, 1], [firsts[0][-1], firsts[1][-1]], [len(prompts[0]) + i, len(prompts[1]) + i])
            for out, row in zip(firsts, logits):
                out.append(int(np.argmax(row)))
        return firsts

    assert together(fixed) == together(views)  # NOTE(tests): exact: the same row counts (16-token chunks, two rows)



def test_a_bucket_on_a_session_of_its_own_stand_in_for_the_cuda_one_row_session(model, tmp_path: Path):
    """``bucket_sessions`` (the CUDA one-row step's session without the fused INT4 kernels): one-row decode steps run
    on the other session, wider ones on the decoder's, and the tokens equal a one-session runner's. The other
    session's own profile counts its runs."""
    from engine.bucket_runner import BucketRunner, DecodePath, RowPrompts

    folder, session, io = model
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "one_row")
    one_row = ort.InferenceSession(str(folder.model_file), so, providers=["CPUExecutionProvider"])

    def runner(**kw) -> BucketRunner:
        kv = KVCache(KVShape(folder.num_layers, 4, folder.num_kv_heads, 96, folder.head_size, io.kv_dtype),
                     HostKVAllocator(POINTER))
        return BucketRunner(session, io, kv, prefill_chunk=16, max_position=96,
                            decode=DecodePath(device_alloc=_cpu_alloc, **kw), prompts=RowPrompts())

    two, one = runner(bucket_sessions={1: one_row, 2: session}), runner()
    assert two.bucket_sessions == {1: one_row}  # the decoder's own session is no other
    prompts = [np.random.default_rng(s).integers(3, 500, n).tolist() for s, n in ((11, 23), (12, 17))]

    def tokens(r: BucketRunner) -> list[list[int]]:
        out = []
        for slot, p in enumerate(prompts):
            for start in range(0, len(p), 16):
                logits = r.prefill(slot, p[start:start + 16], start)
            out.append([int(np.argmax(logits))])
        for i in range(6):  # slot 0 alone (bucket 1), then both (bucket 2)
            slots = [0] if i < 3 else [0, 1]
            logits = r.decode(slots, [out[s][-1] for s in slots],
                              [len(prompts[s]) + len(out[s]) - 1 for s in slots])
            for s, row in zip(slots, logits):
                out[s].append(int(np.argmax(row)))
        return out

    assert tokens(two) == tokens(one)  # NOTE(tests): exact: the same row counts on both (one row, then two)
    events = json.loads(Path(one_row.end_profiling()).read_text())
    assert sum(e.get("name") == "model_run" for e in events) == 3  # the three one-row steps, nothing else

def test_fixed_chunk_shapes_stand_in_for_cuda_give_the_row_view_tokens(pair, tiny_model: Path):
    """With fixed shapes (the CUDA default) a chunk runs as pieces of warmed lengths (45 tokens: 32 + 13); the
    tokens equal the row-view engine's, a draft check's pieces join into one [S, V], and the warm-up runs every
    piece length once."""
    views, _ = pair
    engine = AsyncEngine.from_model_dir(tiny_model, EngineConfig(kv_rows="pointer", fixed_chunk_shapes=True,
                                                                 max_batch=4, prefill_chunk=64,
                                                                 speculative_tokens=0, batched_prompts=False))
    try:
        runner = engine._core.runner  # test only: nothing runs yet
        chunks = runner.chunks
        assert chunks.fixed_shapes
        assert chunks.warm_shapes() == len(chunk_shapes(64))  # no drafts: no draft-check lengths
        assert chunks.warm_shapes(max_verify=17) == len(chunk_shapes(64)) + 16 and runner.slot_len[0] == 0
        ps = _prompts(views.vocab_size, 3, 45, seed=5)
        params = SamplingParams(max_tokens=10, **GREEDY)
        before = chunks.num_runs
        got = [_tokens(asyncio.run(_collect(engine, p, params, f"f{i}"))) for i, p in enumerate(ps)]
        assert chunks.num_runs - before == sum(len(chunk_pieces(len(p))) for p in ps) > len(ps)
        # NOTE(tests): exact: one request at a time, no drafts, on both: prompt pieces of >= 2 rows (32 + 13, 48,
        # 48 + 3 here; 16-token chunks there: a row's result doesn't depend on how many >= 2 share its run), then one
        # row alone
        assert got == [_tokens(asyncio.run(_collect(views, p, params, f"v{i}"))) for i, p in enumerate(ps)]
        # a 19-token run in slot 3 (16 + 3): its [S, V] logits equal one whole run's (unsplit) to float32 noise
        ids = ps[0][:19]
        split = chunks.run(3, ids, 0, all_logits=True).copy()
        chunks.fixed_shapes = False
        whole = chunks.run(3, ids, 0, all_logits=True).copy()
        assert split.shape == whole.shape == (19, engine.vocab_size)
        np.testing.assert_allclose(split, whole, rtol=1e-4, atol=1e-4)
    finally:
        engine.shutdown()


def test_the_row_summary_of_a_captured_step_stand_in_for_cuda_is_each_rows_argmax_and_log_normalizer(model):
    """The decode graph the CUDA EP captures, with each row's argmax and log-normalizer as two more outputs
    (``engine.graph_capture.add_row_summary``), run on the CPU EP through the same fixed-buffer runner: the summary
    is the argmax and log-sum-exp of the logits the step returns, and greedy tokens and logprobs sampled from it
    are those of the CPU's own pass over the logits."""
    from engine.bucket_runner import BucketRunner, DecodePath, RowPrompts
    from engine.graph_capture import capture_graph_bytes
    from engine.sampler import RequestSampler, needs_logits, sample_batch

    folder, _, _ = model
    session, _ = create_session(folder, EngineConfig(max_batch=4), model_bytes=capture_graph_bytes(
        folder, 96, row_summary=True))
    io = check_graph(folder, session)
    plain, _ = create_session(folder, EngineConfig(max_batch=4))

    kv = KVCache(KVShape(folder.num_layers, 4, folder.num_kv_heads, 96, folder.head_size, io.kv_dtype),
                 HostKVAllocator(POINTER))
    runner = BucketRunner(session, io, kv, prefill_chunk=16, max_position=96,
                          decode=DecodePath(device_alloc=_cpu_alloc, row_summary=True),
                          prompts=RowPrompts(plain, check_graph(folder, plain)))
    prompts = [np.random.default_rng(s).integers(3, 500, n).tolist() for s, n in ((3, 21), (4, 9), (5, 14))]
    last = []
    for slot, p in enumerate(prompts):
        for start in range(0, len(p), 16):
            logits = runner.prefill(slot, p[start:start + 16], start)
        last.append(int(np.argmax(logits)))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=True, top_logprobs=3)
    for i in range(4):
        slots = [0, 2] if i % 2 else [0, 1, 2]  # a step over part of a bucket, too
        logits = runner.decode(slots, [last[s] for s in slots], [len(prompts[s]) + i for s in slots])
        assert runner.decode_summary is not None
        argmax, log_norm, token_logprob = runner.decode_summary
        wide = logits.astype(np.float64)
        np.testing.assert_array_equal(argmax, wide.argmax(axis=-1))
        reference = wide.max(axis=-1) + np.log(np.exp(wide - wide.max(axis=-1, keepdims=True)).sum(axis=-1))
        np.testing.assert_allclose(log_norm, reference, rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(token_logprob, wide.max(axis=-1) - reference, rtol=1e-6, atol=1e-5)
        fresh = [RequestSampler(params, prompts[s], runner.vocab_size) for s in slots]
        device = sample_batch(logits, fresh, summary=runner.decode_summary)
        host = sample_batch(logits, [RequestSampler(params, prompts[s], runner.vocab_size) for s in slots])
        assert [r.token_id for r in device] == [r.token_id for r in host] == argmax.tolist()
        for d, h in zip(device, host):
            assert d.logprob.token_id == h.logprob.token_id
            assert abs(d.logprob.logprob - h.logprob.logprob) < 1e-4
            assert [t for t, _ in d.logprob.top] == [t for t, _ in h.logprob.top]
            np.testing.assert_allclose([v for _, v in d.logprob.top], [v for _, v in h.logprob.top], atol=1e-4)
        # an all-greedy step that asks for no alternatives needs no logits on the host: the summary stands in
        plain = SamplingParams(temperature=0.0, max_tokens=8, logprobs=True)
        again = [RequestSampler(plain, prompts[s], runner.vocab_size) for s in slots]
        assert not needs_logits(again) and needs_logits(fresh) and needs_logits(again, masked_rows=[0])
        summary_only = sample_batch(None, again, summary=runner.decode_summary)
        with_logits = sample_batch(logits, [RequestSampler(plain, prompts[s], runner.vocab_size) for s in slots])
        assert [r.token_id for r in summary_only] == [r.token_id for r in with_logits] == argmax.tolist()
        np.testing.assert_allclose([r.logprob.logprob for r in summary_only],
                                   [r.logprob.logprob for r in with_logits], atol=1e-4)
        with pytest.raises(ValueError, match="row summary"):
            sample_batch(None, fresh, summary=runner.decode_summary)
        for s, t in zip(slots, argmax.tolist()):
            last[s] = t
    # the same step without its logits: None, and the same summary
    slots = [0, 1, 2]
    before = runner.decode(slots, [last[s] for s in slots], [len(prompts[s]) + 4 for s in slots]).copy()
    summary = [a.copy() for a in runner.decode_summary]
    for s in slots:
        runner.slot_len[s] -= 1  # the same positions again: the same KV is written, the same logits come out
    assert runner.decode(slots, [last[s] for s in slots], [len(prompts[s]) + 4 for s in slots], logits=False) is None
    for a, b in zip(summary, runner.decode_summary):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(summary[0], before.argmax(axis=-1))


@pytest.mark.parametrize("rows,fixed", [("pointer", True), (None, False)], ids=["pointer-fixed", "host-exact"])
def test_a_burst_of_prompts_run_together_stand_in_for_cuda_gives_the_row_view_tokens(pair, tiny_model: Path,
                                                                                      rows, fixed):
    """Batched prompts (the CUDA default): new requests arriving together run all but their last prompt token in
    one right-padded first-prompt run per group of consecutive slots, and their last tokens decode with the running
    stream. Held at a DecodeGate while the burst arrives, so the burst lands in one step by construction: a
    one-token prompt, an n = 2 request, a prompt longer than one run and a reused prefix take the ordinary path
    beside it. Every request's tokens equal the row-view engine's, and the batched run is counted."""
    from tests.conftest import DecodeGate

    views, _ = pair
    gate = DecodeGate()
    engine = AsyncEngine.from_model_dir(tiny_model, EngineConfig(
        kv_rows=rows, fixed_chunk_shapes=fixed, batched_prompts=True, max_batch=8, prefill_chunk=96,
        speculative_tokens=0, fault_injector=gate, min_prefix_reuse=1))
    try:
        runner = engine._core.runner  # test only
        assert runner.can_batch_prompts and runner.max_batched_prompt == (64 if fixed else 96)
        params = SamplingParams(max_tokens=6, **GREEDY)
        rng = np.random.default_rng(11)
        burst = [rng.integers(3, views.vocab_size, n).tolist() for n in (9, 30, 2, 17, 1, 70)]
        first = rng.integers(3, views.vocab_size, 12).tolist()

        async def scenario(e: AsyncEngine, tag: str, hold: bool):
            if hold:
                gate.shut(after=1)
            running = asyncio.create_task(_collect(e, first, SamplingParams(max_tokens=12, **GREEDY), f"{tag}-r"))
            if hold:
                await asyncio.to_thread(gate.wait_held)
            tasks = [asyncio.create_task(_collect(e, p, params, f"{tag}-{i}")) for i, p in enumerate(burst)]
            tasks.append(asyncio.create_task(_collect(e, burst[0], SamplingParams(max_tokens=6, n=2, **GREEDY),
                                                      f"{tag}-n2")))
            await asyncio.sleep(0.2)
            if hold:
                gate.open()
            outs = [await t for t in tasks]
            again = await _collect(e, burst[1] + [5, 6], params, f"{tag}-again")  # a reused prefix: start > 0
            return [_tokens(await running)] + [_tokens(o) for o in outs[:-1]] + \
                [_tokens(outs[-1], 0), _tokens(outs[-1], 1), _tokens(again)]

        chunks = runner.chunks
        prompt_runs, prompt_rows = chunks.num_prompt_runs, chunks.num_prompt_rows
        got = asyncio.run(scenario(engine, "b", True))
        assert got == asyncio.run(scenario(views, "v", False))
        assert all(len(t) == 6 for t in got[1:])
        # the running request's prompt alone in slot 0, then slots 1-4 (9, 30, 2 and 17 tokens) in one run, with
        # exact shapes the 70-token one too, in a run of its own (it fits a batched run of 96, from the step's prompt
        # budget, but its slot is not next to theirs; with fixed shapes, 64, it takes the token budget in chunks); the
        # one-token prompt, the n = 2 request and the reused prefix run their own chunks
        assert chunks.num_prompt_rows - prompt_rows == (5 if fixed else 6)
        assert chunks.num_prompt_runs - prompt_runs == (2 if fixed else 3)
    finally:
        gate.open()
        engine.shutdown()
