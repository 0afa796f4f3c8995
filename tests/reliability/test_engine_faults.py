"""Engine faults on real sessions: a failing model run, a request the core cannot queue, a dead core thread.

Faults come in through EngineConfig.fault_injector (called just before each session.run); every output
checked against a fresh engine on the same model, up to a near-tie (tests/greedy_close.py: the reference runs each
request alone, the engines under test in batches of two).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import StepInfo
from engine.types import EngineDeadError, EngineOverloadedError, FinishReason, InvalidRequestError, SamplingParams
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close
from tests.reliability.conftest import FaultPlan, wait_idle_engine

# greedy, with each step's top-k for comparing against the reference up to a near-tie
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)


def prompt_ids(engine: AsyncEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.chat_template.render([{"role": "user", "content": text}]))


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str) -> list:
    return [out async for out in engine.generate(prompt, params, rid)]


def token_ids(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def assert_like(expected: GreedyRun, outputs: list, what: str = "") -> None:
    """``outputs`` give ``expected``'s greedy tokens (or a prefix of them, where they end early) up to a near-tie."""
    assert_greedy_close(expected, GreedyRun.from_engine(outputs), TINY_MAX_GAP_NATS, what)


@pytest.fixture(scope="module")
def reference(tiny_model: Path):
    """A fresh engine that never sees a fault: what every request must produce (each run alone)."""
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=2, max_queue=4, prefill_chunk=64))
    cache: dict[tuple[str, int], GreedyRun] = {}

    def tokens(text: str, max_tokens: int) -> GreedyRun:
        if (text, max_tokens) not in cache:
            outs = asyncio.run(collect(eng, prompt_ids(eng, text), SamplingParams(max_tokens=max_tokens, **GREEDY),
                                       f"ref-{len(cache)}"))
            cache[text, max_tokens] = GreedyRun.from_engine(outs)
        return cache[text, max_tokens]

    yield tokens
    eng.shutdown()


@pytest.fixture()
def faulty(tiny_model: Path):
    plan = FaultPlan()
    eng = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=2, max_queue=4, prefill_chunk=64,
                                                              fault_injector=plan))
    yield eng, plan
    eng.shutdown()


def test_a_failed_decode_run_fails_exactly_its_requests_and_the_engine_recovers(faulty, reference) -> None:
    engine, plan = faulty
    texts = ["first story", "second story", "third story, waiting"]

    async def main() -> dict[str, list]:
        outs: dict[str, list] = {t: [] for t in texts}

        async def consume(rid: str, text: str, max_tokens: int) -> None:
            async for out in engine.generate(prompt_ids(engine, text), SamplingParams(max_tokens=max_tokens,
                                                                                       **GREEDY), rid):
                outs[text].append(out)

        # Both slots busy decoding and the third request queued by then: r0's sixth decode run fails.
        plan.arm("decode", "r0", skip=5)
        await asyncio.gather(consume("r0", texts[0], 60), consume("r1", texts[1], 60), consume("r2", texts[2], 30))
        return outs

    outs = asyncio.run(main())
    assert len(plan.fired) == 1 and plan.fired[0].kind == "decode"
    failed_ids = set(plan.fired[0].request_ids)
    assert "r0" in failed_ids and "r2" not in failed_ids  # r2 was still waiting for a slot
    for rid, text in zip(("r0", "r1", "r2"), texts):
        final = outs[text][-1]
        assert [o.finished for o in outs[text]].count(True) == 1 and final.finished
        if rid in failed_ids:
            assert final.finish_reason is FinishReason.ERROR and "InjectedFault" in (final.error or "")
            # What it produced before the fault is a prefix of the fault-free output.
            got = token_ids(outs[text])
            assert 0 < len(got) < 60
            assert_like(reference(text, 60), outs[text], f"{rid} up to its fault")
        else:
            assert final.finish_reason is FinishReason.LENGTH
            assert len(token_ids(outs[text])) == (60 if rid == "r1" else 30)
            assert_like(reference(text, 60 if rid == "r1" else 30), outs[text], rid)
    stats = wait_idle_engine(engine)
    assert stats.num_running == 0 and stats.num_slots_free == stats.num_slots_total == 2

    # The next request (in a slot the failed request held) equals a fresh engine's output.
    after = asyncio.run(collect(engine, prompt_ids(engine, texts[0]), SamplingParams(max_tokens=60, **GREEDY), "r3"))
    assert after[-1].finish_reason is FinishReason.LENGTH
    assert len(token_ids(after)) == 60
    assert_like(reference(texts[0], 60), after, "the request after the fault")


def test_a_failed_prefill_fails_only_that_request(faulty, reference) -> None:
    engine, plan = faulty

    async def main() -> tuple[list, list]:
        stream = engine.generate(prompt_ids(engine, "a long one"), SamplingParams(max_tokens=80, **GREEDY), "long")
        running = [await stream.__anext__(), await stream.__anext__()]  # now decoding
        plan.arm("prefill")
        failed = await collect(engine, prompt_ids(engine, "doomed"), SamplingParams(max_tokens=10, **GREEDY), "bad")
        async for out in stream:
            running.append(out)
        return running, failed

    running, failed = asyncio.run(main())
    assert [(o.finished, o.finish_reason) for o in failed] == [(True, FinishReason.ERROR)]
    assert failed[0].num_generated_tokens == 0 and plan.fired[0].request_ids == ("bad",)
    assert running[-1].finish_reason is FinishReason.LENGTH
    assert len(token_ids(running)) == 80
    assert_like(reference("a long one", 80), running, "the running stream")
    assert wait_idle_engine(engine).num_slots_free == 2


def test_the_hook_sees_every_run_and_costs_nothing_when_unset(tiny_model: Path, reference) -> None:
    seen: list[StepInfo] = []
    engine = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=2, max_queue=4, prefill_chunk=64,
                                                                 fault_injector=seen.append))
    try:
        outs = asyncio.run(collect(engine, prompt_ids(engine, "count the runs"),
                                   SamplingParams(max_tokens=5, **GREEDY), "x"))
    finally:
        engine.shutdown()
    assert len(token_ids(outs)) == 5
    assert_like(reference("count the runs", 5), outs)
    # One prefill run (the prompt fits one 64-token chunk), then one decode run per further token.
    assert [s.kind for s in seen] == ["prefill"] + ["decode"] * 4
    assert all(s.request_ids == ("x",) for s in seen)
    assert EngineConfig().fault_injector is None


def test_params_the_core_cannot_use_fail_only_that_request(faulty, reference) -> None:
    engine, _ = faulty
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=-1)  # rejected before it can reach the core
    bad = SamplingParams(max_tokens=4, seed=1, temperature=1.0)
    object.__setattr__(bad, "seed", -1)  # as if another client skipped the validation: numpy raises on it
    outs = asyncio.run(collect(engine, prompt_ids(engine, "bad seed"), bad, "bad-seed"))
    assert [(o.finished, o.finish_reason) for o in outs] == [(True, FinishReason.ERROR)]
    assert "ValueError" in (outs[0].error or "")
    assert engine.is_running
    good = asyncio.run(collect(engine, prompt_ids(engine, "bad seed"), SamplingParams(max_tokens=12, **GREEDY), "ok"))
    assert len(token_ids(good)) == 12
    assert_like(reference("bad seed", 12), good)


def test_an_overload_found_in_the_core_is_raised_as_overloaded(faulty, reference) -> None:
    engine, _ = faulty
    # NOTE: AsyncEngine's own bound normally refuses first; the core's check is reached only through races
    # (e.g. several event loops), so the test narrows the core's queue to reach it.
    scheduler = engine._core.scheduler
    saved, scheduler.max_waiting = scheduler.max_waiting, 0
    try:
        with pytest.raises(EngineOverloadedError):
            asyncio.run(collect(engine, prompt_ids(engine, "too many"), SamplingParams(max_tokens=4, **GREEDY), "o"))
    finally:
        scheduler.max_waiting = saved
    assert engine.stats().num_waiting == 0 and engine.is_running
    outs = asyncio.run(collect(engine, prompt_ids(engine, "too many"), SamplingParams(max_tokens=8, **GREEDY), "o"))
    assert len(token_ids(outs)) == 8
    assert_like(reference("too many", 8), outs)


class _Fatal(BaseException):
    """Escapes the step's `except Exception`, as a bug in the core loop itself would."""


def test_a_dead_core_fails_every_pending_request_and_refuses_new_ones(tiny_model: Path) -> None:
    def die(info: StepInfo) -> None:
        if info.kind == "decode" and info.step >= 3:
            raise _Fatal("core loop bug")

    engine = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=1, max_queue=4, prefill_chunk=64,
                                                                 fault_injector=die))

    async def one(rid: str) -> BaseException | list:
        try:
            return await asyncio.wait_for(collect(engine, [5, 6, 7, 8], SamplingParams(max_tokens=50, **GREEDY), rid),
                                          timeout=30)
        except EngineDeadError as exc:
            return exc

    async def main() -> list:
        return await asyncio.gather(one("running"), one("waiting-1"), one("waiting-2"))

    try:
        results = asyncio.run(main())  # a hang would be a TimeoutError here
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(engine, [5, 6], SamplingParams(max_tokens=2), "late"))
    finally:
        engine.shutdown(5)
