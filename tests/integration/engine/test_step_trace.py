"""The engine's step trace (EngineConfig.step_trace, ``--step-trace``): one JSON line per step, in and out of an engine
process, whose counts add up to what the requests asked for, and one per garbage collection. Real sessions on the
tiny model."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import SamplingParams
from tests.integration.engine.test_engine import GREEDY, collect, prompts, token_ids, wait_idle


@pytest.mark.parametrize("engine_process", [False, True], ids=["in_process", "engine_process"])
def test_each_step_is_a_line_whose_counts_add_up(tiny_model: Path, tmp_path: Path, engine_process: bool) -> None:
    trace = tmp_path / "steps.jsonl"
    engine = AsyncEngine.from_model_dir(tiny_model, EngineConfig(
        max_batch=4, prefill_chunk=16, seed=0, speculative_tokens=0, prefix_caching=False,
        engine_process=engine_process, step_trace=str(trace)))
    t_start = time.time()
    try:
        ps = prompts(engine, 3, length=10, seed=5) + prompts(engine, 1, length=40, seed=6)  # the last: 3 chunks
        params = SamplingParams(max_tokens=9, **GREEDY)

        async def all_of_them():
            return await asyncio.gather(*(collect(engine, p, params, f"r{i}") for i, p in enumerate(ps)))
        outs = asyncio.run(all_of_them())
        asyncio.run(wait_idle(engine))
        if not engine_process:
            gc.collect()  # the core's process is this one: its collections are recorded

        def traced() -> tuple[int, int]:  # (steps, decode rows) so far: the file is line-buffered
            steps = [json.loads(line) for line in trace.read_text().splitlines() if '"gc"' not in line]
            return len(steps), sum(r["decode"] for r in steps)
        # NOTE(test): a step's line is written as it ends, after its outputs went out with a snapshot that counts the
        # steps before it; the engine goes idle after the step that decoded the last rows, and its count follows
        deadline = time.monotonic() + 30
        while (traced()[1] < len(ps) * 8 or engine.stats().extra["steps_total"] != traced()[0]) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        steps_total = engine.stats().extra["steps_total"]
    finally:
        engine.shutdown()  # closes the trace
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in lines if "gc" not in r]
    assert len(steps) == steps_total > 0
    assert sum(len(token_ids(o)) for o in outs) == len(ps) * 9
    # every prompt token ran in a chunk of its own run (batched prompts are off on the CPU); each request's first
    # token came from its last chunk, the other 8 from decode rows
    assert sum(sum(r["prefill"]) for r in steps) == sum(len(p) for p in ps)
    assert all(0 < n <= 16 for r in steps for n in r["prefill"])
    # each prompt starts at 0; the 40-token one goes on from where its last chunk ended (the budget is shared)
    chunks = sorted((s, n) for r in steps for s, n in zip(r["prefill_start"], r["prefill"]))
    assert [s for s, _ in chunks].count(0) == 4
    later = [(s, n) for s, n in chunks if s]
    assert later and later[0][0] in {n for s, n in chunks if s == 0}
    assert [s for s, _ in later[1:]] == [s + n for s, n in later[:-1]]
    assert later[-1][0] + later[-1][1] == 40
    assert sum(r["decode"] for r in steps) == len(ps) * 8 and not any(r["joined"] or r["verify"] for r in steps)
    assert [r["t"] for r in steps] == sorted(r["t"] for r in steps) and t_start - 1 < steps[0]["t"] < time.time()
    assert steps[0]["idle_ms"] is None and all(r["idle_ms"] >= 0 for r in steps[1:])
    for r in steps:
        assert r["ms"] >= sum(r["phases_ms"].values()) - 1e-3 and set(r["phases_ms"]) <= {
            "schedule", "decode_run", "decode_sample", "decode_update", "verify", "prefill"}
        assert ("prefill" in r["phases_ms"]) == bool(r["prefill"]) and ("decode_run" in r["phases_ms"]) == bool(
            r["decode"])
        # every session run of the step, timed within it: one decode run per decode step, a run per prompt chunk
        assert sum(ms for _, ms in r["runs"]) <= r["ms"] + 1e-3
        assert [name for name, _ in r["runs"]].count("decode") == (1 if r["decode"] else 0) + len(r["prefill"])
    collections = [r for r in lines if "gc" in r]
    if not engine_process:
        assert any(r["gc"] == 2 and r["ms"] >= 0 and r["thread"] == "MainThread" for r in collections)


def test_the_loop_probe_records_a_callback_that_held_the_loop(tmp_path: Path) -> None:
    """engine.step_trace.watch_loop (the server's side): a callback that blocks the event loop for 80 ms shows up
    as a wake-up at least that late, from when the probe was due."""
    from engine.step_trace import TraceFile, watch_loop

    path = tmp_path / "loop.jsonl"
    trace = TraceFile(str(path), "server", collections=False)

    async def main() -> None:
        probe = asyncio.create_task(watch_loop(trace))
        await asyncio.sleep(0.05)
        before = time.time()
        time.sleep(0.08)  # holds the loop: nothing else runs meanwhile
        await asyncio.sleep(0.05)
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
        lags = [json.loads(line) for line in path.read_text().splitlines()]
        held = [r for r in lags if r["ms"] >= 75.0 and before - 0.01 <= r["t"] <= before + 0.08]
        assert len(held) == 1 and held[0]["lag"] and held[0]["proc"] == "server"

    try:
        asyncio.run(main())
    finally:
        trace.close()
