"""AsyncEngine on a real session: continuous batching, determinism, stops, cancellation, bounds."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import (
    EngineDeadError, EngineOverloadedError, FinishReason, InvalidRequestError, PromptTooLongError, SamplingParams,
)
from tests.conftest import DecodeGate
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close


GREEDY = dict(temperature=0.0, ignore_eos=True)
# greedy with each step's top-k, for comparing two paths up to a near-tie (tests/greedy_close.py)
GREEDY_TOP = dict(GREEDY, logprobs=True, top_logprobs=TOP_K)


async def collect(engine: Any, prompt: list[int], params: SamplingParams, rid: str) -> list:
    return [out async for out in engine.generate(prompt, params, rid)]


def token_ids(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def assert_close(ref: list, got: list, what: str = "") -> None:
    """``got``'s greedy tokens equal ``ref``'s up to a near-tie of the tiny model (both asked with GREEDY_TOP)."""
    assert_greedy_close(GreedyRun.from_engine(ref), GreedyRun.from_engine(got), TINY_MAX_GAP_NATS, what)


def run(coro):
    return asyncio.run(coro)


async def wait_idle(engine: Any, timeout_s: float = 5.0) -> None:
    """Until the engine reports nothing running or waiting and every slot free."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_slots_free == s.num_slots_total:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engine not idle after {timeout_s}s: {s}")
        await asyncio.sleep(0.01)


def prompts(engine, n, length=12, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, engine.vocab_size) for _ in range(length + i)] for i in range(n)]


def check_stream(outputs, engine):
    """Exactly one finished output, at the end; text deltas add up to the decoded tokens."""
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    assert outputs[-1].num_generated_tokens == len(token_ids(outputs))


def test_batched_greedy_equals_single(engine):
    ps = prompts(engine, 8, length=10)
    alone = run(collect(engine, ps[0], SamplingParams(max_tokens=24, **GREEDY_TOP), "alone"))

    async def batch():
        return await asyncio.gather(*[collect(engine, p, SamplingParams(max_tokens=24, **GREEDY_TOP), f"b{i}")
                                      for i, p in enumerate(ps)])

    together = run(batch())
    # NOTE(tests): a lone decode row and a row of a batch round differently (tests/greedy_close.py)
    assert_close(alone, together[0], "batched against alone")
    assert len(token_ids(alone)) == 24 and alone[-1].finish_reason is FinishReason.LENGTH
    for outs in together:
        check_stream(outs, engine)
    # the companions are really different streams
    assert len({tuple(token_ids(o)) for o in together}) > 1


def test_each_request_equals_its_own_single_run_in_a_staggered_batch(engine):
    ps = prompts(engine, 5, length=20, seed=1)  # 20+ tokens: chunked at 16
    singles = [run(collect(engine, p, SamplingParams(max_tokens=12, **GREEDY_TOP), f"s{i}")) for i, p in enumerate(ps)]

    async def staggered():
        tasks = []
        for i, p in enumerate(ps):
            tasks.append(asyncio.create_task(collect(engine, p, SamplingParams(max_tokens=12, **GREEDY_TOP), f"t{i}")))
            await asyncio.sleep(0.003 * i)  # join while others decode
        return await asyncio.gather(*tasks)

    for i, (single, got) in enumerate(zip(singles, run(staggered()))):
        assert_close(single, got, f"request {i} staggered against alone")


def test_same_seed_same_text_whatever_the_companions(engine):
    p = prompts(engine, 1, seed=2)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run(collect(engine, p, params, "seed-alone"))

    async def crowd():
        others = [collect(engine, q, SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True), f"o{i}")
                  for i, q in enumerate(prompts(engine, 5, seed=3))]
        results = await asyncio.gather(collect(engine, p, params, "seed-crowd"), *others)
        return results[0]

    crowded = run(crowd())
    # NOTE(tests): exact: seeded sampling across batches (docs/development.md, "Tests on model output")
    assert token_ids(crowded) == token_ids(alone)
    assert "".join(o.text for o in crowded) == "".join(o.text for o in alone)
    unseeded = run(collect(engine, p, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True), "u"))
    assert token_ids(unseeded) != token_ids(alone)  # the seed is what made them equal


def test_chunked_prefill_equals_unchunked(engine, single_engine):
    p = prompts(engine, 1, length=50, seed=4)[0]  # 4 chunks of 16 vs 1 chunk of 64
    params = SamplingParams(max_tokens=16, **GREEDY_TOP)
    a = run(collect(engine, p, params, "chunked"))
    b = run(collect(single_engine, p, params, "whole"))
    assert_close(b, a, "chunked against whole prefill")


def test_stop_string_is_cut_and_never_streamed(engine):
    p = prompts(engine, 1, seed=5)[0]
    full = run(collect(engine, p, SamplingParams(max_tokens=40, **GREEDY), "full"))
    text = "".join(o.text for o in full)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text.find(stop)
    # NOTE(tests): exact: the same request alone twice runs the same row counts (see conftest.py's note)
    outs = run(collect(engine, p, SamplingParams(max_tokens=40, stop=(stop,), **GREEDY), "stop"))
    check_stream(outs, engine)
    assert outs[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in outs) == text[:cut]
    seen = ""
    for o in outs:
        seen += o.text
        assert stop not in seen
    assert outs[-1].num_generated_tokens < 40


def test_eos_ends_with_stop_and_max_tokens_with_length(engine):
    p = prompts(engine, 1, seed=6)[0]
    eos = min(engine.eos_token_ids)
    outs = run(collect(engine, p, SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((eos, 100.0),)), "e"))
    assert outs[-1].finish_reason is FinishReason.STOP and token_ids(outs) == [eos]
    assert "".join(o.text for o in outs) == ""
    outs = run(collect(engine, p, SamplingParams(max_tokens=7, **GREEDY), "len"))
    assert outs[-1].finish_reason is FinishReason.LENGTH and len(token_ids(outs)) == 7


def test_stop_token_ids_end_the_request(engine):
    p = prompts(engine, 1, seed=7)[0]
    first = token_ids(run(collect(engine, p, SamplingParams(max_tokens=5, **GREEDY), "probe")))
    # NOTE(tests): exact: the same request alone twice runs the same row counts (see conftest.py's note)
    outs = run(collect(engine, p, SamplingParams(max_tokens=5, stop_token_ids=(first[2],), **GREEDY), "sid"))
    assert outs[-1].finish_reason is FinishReason.STOP
    assert token_ids(outs) == first[:first.index(first[2]) + 1]


def test_context_end_is_length(engine):
    p = prompts(engine, 1, length=engine.max_model_len - 5, seed=8)[0]
    outs = run(collect(engine, p, SamplingParams(max_tokens=100, **GREEDY), "ctx"))
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert len(token_ids(outs)) == 5


def test_prompt_too_long_and_bad_ids_are_refused(engine):
    with pytest.raises(PromptTooLongError) as info:
        run(collect(engine, [5] * engine.max_model_len, SamplingParams(), "long"))
    assert info.value.num_prompt_tokens == engine.max_model_len
    with pytest.raises(InvalidRequestError):
        run(collect(engine, [], SamplingParams(), "empty"))
    with pytest.raises(InvalidRequestError):
        run(collect(engine, [engine.vocab_size], SamplingParams(), "oov"))


def test_logprobs_come_with_each_token(engine):
    p = prompts(engine, 1, seed=9)[0]
    outs = run(collect(engine, p, SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY), "lp"))
    lps = [lp for o in outs for lp in o.logprobs]
    assert [lp.token_id for lp in lps] == token_ids(outs)
    for lp in lps:  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.logprob <= 0.0


def test_chat_template_prompt_generates(engine):
    text = engine.chat_template.render([{"role": "user", "content": "Hello, 世界!"}])
    ids = engine.tokenizer.encode(text)
    outs = run(collect(engine, ids, SamplingParams(max_tokens=8, **GREEDY), "chat"))
    check_stream(outs, engine)


def test_cancelled_request_frees_its_slot(engine, engine_gate):
    p = prompts(engine, 1, seed=10)[0]

    async def cancel_after_three():
        got = []

        async def consume():
            async for out in engine.generate(p, SamplingParams(max_tokens=200, **GREEDY), "cancel-me"):
                got.append(out)

        engine_gate.shut(after=2)  # three tokens (prefill and two decodes), then it waits: still running
        try:
            task = asyncio.create_task(consume())
            while sum(len(o.token_ids) for o in got) < 3:
                await asyncio.sleep(0.001)
            assert engine.stats().num_running == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            engine_gate.open()
        await wait_idle(engine)
        return got

    got = run(cancel_after_three())
    assert not any(o.finished for o in got)


def test_breaking_out_of_the_stream_aborts(engine):
    p = prompts(engine, 1, seed=11)[0]

    async def break_early():
        gen = engine.generate(p, SamplingParams(max_tokens=200, **GREEDY), "break-me")
        async for _ in gen:
            break
        await gen.aclose()
        await wait_idle(engine)

    run(break_early())


def test_random_submit_and_cancel_sequences_leave_no_slot_in_use(engine):
    rng = random.Random(12)
    ps = prompts(engine, 6, length=rng.randrange(3, 40), seed=12)

    async def scenario(k):
        async def one(i):
            params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=rng.choice([0.0, 1.0]),
                                    ignore_eos=rng.random() < 0.5)
            return await collect(engine, rng.choice(ps), params, f"rand-{k}-{i}")

        tasks = [asyncio.create_task(one(i)) for i in range(rng.randrange(1, 10))]
        await asyncio.sleep(rng.random() * 0.005)
        for t in tasks:
            if rng.random() < 0.4:
                t.cancel()
        for t in tasks:
            try:
                check_stream(await t, engine)
            except asyncio.CancelledError:
                pass

    async def main():
        for k in range(100):
            await scenario(k)
        await wait_idle(engine)

    run(main())


def test_queue_bound_raises_overloaded(single_engine, single_engine_gate):
    p = prompts(single_engine, 1, seed=13)[0]

    async def main():
        started = asyncio.Event()
        outs: dict[str, list] = {}

        async def consume(rid):
            outs[rid] = []
            async for out in single_engine.generate(p, SamplingParams(max_tokens=60, **GREEDY), rid):
                outs[rid].append(out)
                started.set()

        single_engine_gate.shut()  # the first request holds the only slot until the gate opens
        try:
            tasks = [asyncio.create_task(consume(f"q{i}")) for i in range(3)]  # 1 running + 2 waiting
            await started.wait()
            assert single_engine.stats().num_waiting == 2
            with pytest.raises(EngineOverloadedError):
                await collect(single_engine, p, SamplingParams(max_tokens=1), "one-too-many")
        finally:
            single_engine_gate.open()
        await asyncio.gather(*tasks)
        assert all(len(token_ids(o)) == 60 for o in outs.values())
        await wait_idle(single_engine)

    run(main())


def test_duplicate_request_id_is_refused(engine, engine_gate):
    p = prompts(engine, 1, seed=14)[0]

    async def main():
        engine_gate.shut()  # "dup" stays running while the second one arrives
        try:
            gen = engine.generate(p, SamplingParams(max_tokens=50, **GREEDY), "dup")
            await gen.__anext__()
            with pytest.raises(InvalidRequestError):
                await collect(engine, p, SamplingParams(max_tokens=1), "dup")
        finally:
            engine_gate.open()
        await gen.aclose()
        await wait_idle(engine)

    run(main())


@pytest.mark.parametrize("config", [dict(kv_rows="opaque"), dict(provider="auto")],
                         ids=["whole_buffer", "provider_auto_via_ep"])
def test_other_binding_paths_give_the_same_tokens(engine, tiny_model, config):
    ps = prompts(engine, 3, length=20, seed=15)
    params = SamplingParams(max_tokens=10, **GREEDY_TOP)
    expected = [run(collect(engine, p, params, f"ref{i}")) for i, p in enumerate(ps)]
    other = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=4, prefill_chunk=16, **config))
    try:
        async def together():
            return await asyncio.gather(*[collect(other, p, params, f"x{i}") for i, p in enumerate(ps)])

        for i, (ref, got) in enumerate(zip(expected, run(together()))):  # batched there, alone here
            assert_close(ref, got, f"request {i}")
    finally:
        other.shutdown()


def test_shutdown_ends_streams_and_refuses_new_work(tiny_model):
    gate = DecodeGate()
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=2, prefill_chunk=16, fault_injector=gate))
    p = list(range(5, 20))

    async def main():
        gate.shut()  # the request cannot finish before the shutdown, whatever the machine's speed
        gen = eng.generate(p, SamplingParams(max_tokens=200, **GREEDY), "long")
        first = await gen.__anext__()
        assert not first.finished
        shutdown = asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        while eng.is_running:  # until the shutdown has begun (the core thread is held at the gate)
            await asyncio.sleep(0.001)
        gate.open()
        await shutdown
        rest = [o async for o in gen]
        assert rest and rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT
        with pytest.raises(EngineDeadError):
            await collect(eng, p, SamplingParams(), "after")

    run(main())


def test_abort_ends_a_consumer_with_abort_and_the_id_can_be_reused(engine, engine_gate):
    p = prompts(engine, 1, seed=16)[0]
    params = SamplingParams(max_tokens=200, **GREEDY)

    async def main():
        outs = []

        async def consume():
            async for out in engine.generate(p, params, "reuse"):
                outs.append(out)
                if sum(len(o.token_ids) for o in outs) == 2:
                    await engine.abort("reuse")

        engine_gate.shut(after=1)  # two tokens, then it waits: still running when aborted, on any machine
        try:
            await asyncio.wait_for(consume(), 5)
        finally:
            engine_gate.open()
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORT
        assert [o.finished for o in outs].count(True) == 1
        # the same id at once: the old request's late outputs must not leak into the new one (NOTE(tests): exact:
        # both ran alone, the same row counts, see conftest.py's note)
        again = await collect(engine, p, SamplingParams(max_tokens=5, **GREEDY), "reuse")
        assert token_ids(again) == token_ids(outs)[:5] or len(token_ids(outs)) < 5
        assert len(token_ids(again)) == 5 and again[-1].finish_reason is FinishReason.LENGTH
        await wait_idle(engine)

    run(main())
