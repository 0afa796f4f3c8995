"""Priorities on real sessions of the default model: batch-like requests (priority 1) fill every row, an interactive
request (priority 0) arrives and takes a row at once (a batch request is preempted and computed again), and every
request's greedy text is the one it has alone, by the suite's near-tie rule (tests/greedy_close.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import SamplingParams
from tests.greedy_close import TOP_K, GreedyRun, assert_greedy_close

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)


def prompt(engine: AsyncEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.chat_template.render([{"role": "user", "content": text}]))


def test_an_interactive_request_preempts_a_batch_request_and_every_text_is_its_own(default_model: Path) -> None:
    engine = AsyncEngine.from_model_dir(default_model, EngineConfig(max_batch=2, max_queue=8, seed=0))
    # NOTE(tests): no row kept for interactive requests (engine.row_holds): the alone runs' last row would be free
    # for the interactive request, and this test is about one that finds every row taken (set before any request)
    engine._core.scheduler.holds.hold_s = 0.0
    try:
        texts = ["Name four rivers.", "List three colors.", "Count to ten."]
        prompts = [prompt(engine, t) for t in texts]

        async def alone() -> list[list]:
            return [[o async for o in engine.generate(p, PARAMS, f"alone-{i}")] for i, p in enumerate(prompts)]

        async def together() -> tuple[list[list], int]:
            async def run(i: int, priority: int) -> list:
                return [o async for o in engine.generate(prompts[i], PARAMS, f"run-{i}", priority=priority)]

            before = engine.stats().generation_tokens_total
            batch = [asyncio.create_task(run(i, 1)) for i in range(2)]  # both rows
            while engine.stats().generation_tokens_total < before + 8:  # both batch requests are decoding
                await asyncio.sleep(0.005)
            interactive = await run(2, 0)
            preempted = engine._core.scheduler.num_preemptions_total
            return [*(await asyncio.gather(*batch)), interactive], preempted

        refs = asyncio.run(alone())
        gots, preemptions = asyncio.run(together())
    finally:
        engine.shutdown()
    assert preemptions >= 1  # the interactive request found both rows taken by batch requests
    for i, (ref, got) in enumerate(zip(refs, gots)):
        assert len([t for o in got for t in o.token_ids]) == 24
        assert_greedy_close(GreedyRun.from_engine(ref), GreedyRun.from_engine(got), what=texts[i])
