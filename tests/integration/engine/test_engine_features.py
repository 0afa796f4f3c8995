"""Prefix reuse, n > 1 and speculative decoding on real sessions of the tiny model (and, for speed-free
properties, the default model): same tokens as the plain path, cached-token counts, the sampling law."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_cache import HostKVAllocator, KVCache, KVShape
from engine.model_loader import check_graph, create_session, read_model_folder
from engine.runner import Runner
from engine.sampler import RequestSampler
from engine.speculative import NgramDrafter
from engine.types import FinishReason, InvalidRequestError, SamplingParams
from tests.chi_square import chi_square_p_value
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close

GREEDY = dict(temperature=0.0, ignore_eos=True)
# greedy with each step's top-k, for comparing two paths up to a near-tie (tests/greedy_close.py)
GREEDY_TOP = dict(GREEDY, logprobs=True, top_logprobs=TOP_K)


def make_engine(model: Path, **kw) -> AsyncEngine:
    config = dict(max_batch=4, max_queue=64, prefill_chunk=32, seed=0)
    config.update(kw)
    return AsyncEngine.from_model_dir(model, EngineConfig(**config))


@pytest.fixture(scope="module")
def engines(tiny_model: Path):
    """warm: prefix caching and speculation on (the defaults); cold: both off."""
    warm = make_engine(tiny_model)
    # NOTE(tests): drafts are priced by measured time; the tests that count drafts must not depend on how loaded the
    # machine is, so the warm engine keeps the prior law (the core thread reads the flag before its first step).
    warm._core.scheduler.check_cost.freeze()
    cold = make_engine(tiny_model, prefix_caching=False, speculative_tokens=0)
    yield warm, cold
    warm.shutdown()
    cold.shutdown()


async def generate(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str) -> list:
    return [out async for out in engine.generate(prompt, params, rid)]


def tokens(outputs: list, index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.token_ids]


def assert_close(ref: list, got: list, what: str = "", ref_index: int = 0, got_index: int = 0) -> None:
    """Choice ``got_index`` of ``got`` equals choice ``ref_index`` of ``ref`` up to a near-tie of the tiny model."""
    assert_greedy_close(GreedyRun.from_engine(ref, ref_index), GreedyRun.from_engine(got, got_index),
                        TINY_MAX_GAP_NATS, what)


# NOTE(tests): the comparisons below that use a repetition penalty stay exact: the log-probabilities a request
# reports are the model's raw ones, and a penalty moves the greedy choice away from them, so the near-tie rule
# can't judge where such runs part. The tiny model computes in float32 (its paths part by float rounding only,
# <= 3.1e-5 nats on AVX-512 and AVX2 alike: tests/greedy_close.py), so they part only at a tie that close.


def random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# -- prefix reuse ------------------------------------------------------------------------------------


def test_prefix_reuse_gives_the_cold_greedy_text_and_reports_cached_tokens(engines) -> None:
    warm, cold = engines
    system = random_ids(40, seed=1)  # shared by two "users"
    first = system + random_ids(9, seed=2)
    second = system + [7] + random_ids(9, seed=3)  # differs from `first` right after the system part
    params = SamplingParams(max_tokens=12, **GREEDY_TOP)

    async def main():
        a = await generate(warm, first, params, "a")
        b = await generate(warm, second, params, "b")
        # a next turn: the conversation so far (prompt + answer) plus new text
        turn2 = first + tokens(a) + random_ids(5, seed=4)
        c = await generate(warm, turn2, params, "c")
        cold_b = await generate(cold, second, params, "cb")
        cold_c = await generate(cold, turn2, params, "cc")
        return a, b, c, cold_b, cold_c

    hits_before = warm.stats().extra["prefix_cache_hits_total"]
    a, b, c, cold_b, cold_c = asyncio.run(main())
    # NOTE(tests): reused KV was computed in other runs (c's includes a's answer, decoded one row at a time)
    assert_close(cold_b, b, "b reusing the system part")
    assert_close(cold_c, c, "the next turn reusing the conversation")
    assert b[0].num_cached_tokens == 40  # the system part (a's slot held it; b took another slot and copied)
    # every token of a's prompt and answer but the last answer token (sampled, never run) was cached
    assert c[-1].num_cached_tokens == len(first) + 12 - 1
    assert cold_b[-1].num_cached_tokens == cold_c[-1].num_cached_tokens == 0
    assert warm.stats().extra["prefix_cache_hits_total"] - hits_before >= 40 + len(first) + 11


def test_a_running_requests_prompt_is_copied_into_a_new_slot(engines) -> None:
    warm, cold = engines
    system = random_ids(48, seed=11)
    long_one, other = system + random_ids(4, seed=12), system + [9] + random_ids(4, seed=13)

    async def main():
        stream = warm.generate(long_one, SamplingParams(max_tokens=150, **GREEDY), "long")
        first = await stream.__anext__()  # its prompt is computed: the slot holds the system part
        b = await generate(warm, other, SamplingParams(max_tokens=10, **GREEDY_TOP), "other")
        assert not first.finished
        rest = [first] + [o async for o in stream]
        return b, rest, await generate(cold, other, SamplingParams(max_tokens=10, **GREEDY_TOP), "cold")

    b, rest, cold_b = asyncio.run(main())
    assert b[0].num_cached_tokens == 48
    assert_close(cold_b, b, "beside a running request, its prompt copied")  # batched there, alone here
    assert rest[-1].finish_reason is FinishReason.LENGTH and len(tokens(rest)) == 150


def test_whole_buffer_mode_reuses_a_slots_own_prefix(tiny_model: Path) -> None:
    # NOTE(test): min_prefix_reuse=1: the staged path reuses only a chunk-long prefix by default (a shorter one saves
    # no run), and this test is about the reuse itself
    whole = make_engine(tiny_model, kv_rows="opaque", max_batch=2, min_prefix_reuse=1)
    cold = make_engine(tiny_model, kv_rows="opaque", max_batch=2, prefix_caching=False)
    try:
        prompt = random_ids(20, seed=21)
        params = SamplingParams(max_tokens=6, **GREEDY_TOP)

        async def main():
            a = await generate(whole, prompt, params, "a")
            turn2 = prompt + tokens(a) + random_ids(3, seed=22)
            return await generate(whole, turn2, params, "b"), await generate(cold, turn2, params, "c")

        b, c = asyncio.run(main())
        assert b[0].num_cached_tokens == 20 + 5
        assert_close(c, b, "reusing a's answer (decoded row by row) against cold")
        assert whole.placement.whole_buffer

        # n > 1: the prompt is fed to both rows in the same runs; no draft checks in whole-buffer mode
        async def choices():
            loop_params = SamplingParams(max_tokens=40, repetition_penalty=0.3, **GREEDY)
            two = await generate(whole, prompt, SamplingParams(max_tokens=40, n=2, repetition_penalty=0.3, **GREEDY),
                                 "two")
            return two, await generate(cold, prompt, loop_params, "one")

        two, one = asyncio.run(choices())
        # NOTE(tests): exact: the two choices run as rows of the same runs; against n = 1 see the note on penalties
        assert tokens(two, 0) == tokens(two, 1) == tokens(one)
        assert whole.stats().extra["spec_draft_tokens_total"] == 0
    finally:
        whole.shutdown()
        cold.shutdown()


# -- n > 1 -------------------------------------------------------------------------------------------


def test_n_greedy_choices_equal_the_single_answer_and_the_prompt_runs_once(engines) -> None:
    warm, cold = engines
    prompt = random_ids(30, seed=31)

    async def main():
        single = await generate(cold, prompt, SamplingParams(max_tokens=10, **GREEDY_TOP), "one")
        before = cold.stats().prompt_tokens_total
        three = await generate(cold, prompt, SamplingParams(max_tokens=10, n=3, **GREEDY_TOP), "three")
        return single, three, cold.stats().prompt_tokens_total - before

    single, three, prompt_tokens_run = asyncio.run(main())
    assert prompt_tokens_run == 30  # one prefill for three choices
    for index in range(3):
        # NOTE(tests): the choices decode as a batch of three, the single answer alone
        assert_close(single, three, f"choice {index} against n = 1", got_index=index)
        assert tokens(three, index) == tokens(three, 0)  # NOTE(tests): exact: rows of the same runs
        ends = [o for o in three if o.index == index and o.finish_reason is not None]
        assert [o.finish_reason for o in ends] == [FinishReason.LENGTH]
    assert [o.finished for o in three].count(True) == 1 and three[-1].finished
    assert three[-1].num_generated_tokens == 30 and three[-1].num_prompt_tokens == 30


def test_seeded_choices_are_reproducible_and_differ_from_each_other(engines) -> None:
    warm, _ = engines
    prompt = random_ids(12, seed=41)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, n=4, ignore_eos=True)

    async def main():
        return (await generate(warm, prompt, params, "s1"), await generate(warm, prompt, params, "s2"),
                await generate(warm, prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=1234,
                                                            ignore_eos=True), "s0"))

    first, again, single = asyncio.run(main())
    choices = [tokens(first, i) for i in range(4)]
    assert choices == [tokens(again, i) for i in range(4)]
    # NOTE(tests): exact: seeded sampling across batches (docs/development.md, "Tests on model output")
    assert choices[0] == tokens(single)  # choice 0 draws what n = 1 draws
    assert len({tuple(c) for c in choices}) == 4


def test_n_beyond_the_slots_is_refused_naming_n(engines) -> None:
    warm, _ = engines

    async def main():
        await generate(warm, [5, 6, 7], SamplingParams(max_tokens=2, n=5), "too-many")

    with pytest.raises(InvalidRequestError, match="n must be at most 4") as info:
        asyncio.run(main())
    assert info.value.param == "n"


# -- speculative decoding ----------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [
    dict(temperature=0.0),
    dict(temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3, logit_bias=((100, 1.5), (7, -3.0))),
    dict(temperature=0.5, top_p=0.9, seed=7),
], ids=["greedy", "greedy-penalties-bias", "seeded-sampling"])
def test_speculation_gives_the_plain_tokens(engines, extra) -> None:
    warm, cold = engines
    # NOTE(engine): a repetition penalty below 1 rewards repeats, so the random tiny model falls into loops
    # its own earlier output predicts: drafts get accepted (and rejected where the loop breaks).
    params = SamplingParams(max_tokens=200, ignore_eos=True, repetition_penalty=0.3, **extra)
    before = warm.stats().extra

    async def main():
        pairs = []
        for i in range(4):
            prompt = random_ids(8, seed=50 + i)
            pairs.append((await generate(warm, prompt, params, f"w{i}"), await generate(cold, prompt, params, f"c{i}")))
        return pairs

    for spec, plain in asyncio.run(main()):
        assert tokens(spec) == tokens(plain)  # NOTE(tests): exact: see the note on penalties above
        assert len(tokens(spec)) == 200 and spec[-1].finish_reason is FinishReason.LENGTH
    after = warm.stats().extra
    drafted = after["spec_draft_tokens_total"] - before["spec_draft_tokens_total"]
    accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    assert accepted >= 10 and drafted > accepted  # drafts were kept and rejected


def test_a_stop_token_inside_an_accepted_draft_ends_the_answer_there(engines) -> None:
    warm, cold = engines
    params = SamplingParams(max_tokens=120, **GREEDY, repetition_penalty=0.5)
    prompt = random_ids(8, seed=52)
    reference = tokens(asyncio.run(generate(cold, prompt, params, "ref")))
    stop_at = next(i for i in range(60, 120) if reference[i] not in reference[:i])  # its first appearance
    stopped = SamplingParams(max_tokens=120, temperature=0.0, repetition_penalty=0.5,
                             stop_token_ids=(reference[stop_at],))
    spec = asyncio.run(generate(warm, prompt, stopped, "stop"))
    # NOTE(tests): exact: see the note on penalties above
    assert tokens(spec) == reference[:stop_at + 1] and spec[-1].finish_reason is FinishReason.STOP


def _bruijn(alphabet: list[int], order: int) -> list[int]:
    """A de Bruijn sequence: every ``order``-gram over ``alphabet`` appears (linear form)."""
    k = len(alphabet)
    seq: list[int] = []
    a = [0] * (k * order)

    def db(t: int, p: int) -> None:
        if t > order:
            if order % p == 0:
                seq.extend(a[1:p + 1])
        else:
            a[t] = a[t - p]
            db(t + 1, p)
            for j in range(a[t - p] + 1, k):
                a[t] = j
                db(t + 1, t)

    db(1, 1)
    return [alphabet[i] for i in seq + seq[:order - 1]]


def test_speculative_sampling_keeps_the_distribution(tiny_model: Path) -> None:
    """2,000 seeded requests whose second token is drafted: the three sampled tokens follow the model's own
    joint distribution (Pearson's chi-square), and not the one of the classic mistake (keep the draft with
    probability p(t), then resample from p itself on rejection)."""
    alphabet = [101, 202, 303]
    prompt = random_ids(6, seed=61) + _bruijn(alphabet, 3)  # every 3-gram over the alphabet: always a draft
    # top-k 3 with a +100 bias on the alphabet: the model's own probabilities, restricted to three tokens
    params = dict(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True,
                  logit_bias=tuple((t, 100.0) for t in alphabet))
    num_samples = 2000

    # 1. The exact law, from plain runs of the same folder: p(x0), p(x1 | x0), p(x2 | x0, x1).
    folder = read_model_folder(tiny_model)
    session, _ = create_session(folder, EngineConfig(max_batch=1, prefill_chunk=64))
    io = check_graph(folder, session)
    runner = Runner(session, io, KVCache(KVShape(folder.num_layers, 1, folder.num_kv_heads, 128, folder.head_size,
                                                 io.kv_dtype), HostKVAllocator()), prefill_chunk=64, max_position=128)
    sampler = RequestSampler(SamplingParams(**params), prompt, io.vocab_size)

    def law(context: list[int]) -> dict[int, float]:
        logits = runner.prefill(0, context, 0)
        processed = sampler.process(logits).astype(np.float64)
        probs = np.exp(processed - processed.max())
        probs /= probs.sum()
        return {t: float(probs[t]) for t in alphabet}

    p0 = law(prompt)
    p1 = {x0: law(prompt + [x0]) for x0 in alphabet}
    p2 = {(x0, x1): law(prompt + [x0, x1]) for x0 in alphabet for x1 in alphabet}
    assert abs(sum(p0.values()) - 1) < 1e-6 and min(p0.values()) > 0.01
    cells = list(itertools.product(alphabet, repeat=3))
    exact = [p0[a] * p1[a][b] * p2[a, b][c] for a, b, c in cells]
    # the classic mistake: draft d kept with probability p(d), else a fresh draw from p (d may come again)
    drafts = {x0: NgramDrafter(max_tokens=1).propose(prompt, [x0], limit=1)[0] for x0 in alphabet}
    wrong = []
    for a, b, c in cells:
        d, p = drafts[a], p1[a]
        p_b = p[b] * (1 - p[d]) + (p[d] if b == d else 0.0)
        wrong.append(p0[a] * p_b * p2[a, b][c])

    # 2. The engine with speculation on, each request alone with its draft check (seeds 0..N-1).
    engine = make_engine(tiny_model, max_batch=8, max_queue=num_samples, speculative_max_batch=8,
                         speculative_tokens=4)
    try:
        async def main():
            sem = asyncio.Semaphore(8)

            async def one(seed: int) -> tuple[int, ...]:
                async with sem:
                    outs = await generate(engine, prompt, SamplingParams(seed=seed, **params), f"x{seed}")
                    return tuple(tokens(outs))

            return await asyncio.gather(*[one(seed) for seed in range(num_samples)])

        samples = asyncio.run(main())
        stats = engine.stats().extra
    finally:
        engine.shutdown()
    assert stats["spec_draft_tokens_total"] >= 0.95 * num_samples  # (nearly) every request checked a draft
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_draft_tokens_total"]
    counts = Counter(samples)
    assert sum(counts.values()) == num_samples and set(counts) <= set(cells)
    observed = [counts[cell] for cell in cells]
    stat, p_value, df = chi_square_p_value(observed, [num_samples * e for e in exact])
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {df} degrees of freedom: p = {p_value:.2e}"
    stat, p_wrong, df = chi_square_p_value(observed, [num_samples * e for e in wrong])
    assert p_wrong < 1e-6, f"the test can't tell the wrong rule apart: chi-square {stat:.1f}, p = {p_wrong:.2e}"
