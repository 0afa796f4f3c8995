"""perf.ceiling: the bare ONNX Runtime loop does the engine's work (same greedy tokens) and reports figures."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path

import numpy as np
import pytest

from perf import ceiling
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import SamplingParams, StepInfo
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close

PROMPT = [5, 17, 99, 230, 41, 7, 300, 12]
STEPS = 12


async def _engine_run(engine: AsyncEngine) -> GreedyRun:
    params = SamplingParams(max_tokens=STEPS + 1, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)
    return GreedyRun.from_engine([out async for out in engine.generate(PROMPT, params, "ceiling-test")])


def test_bare_loop_generates_the_engines_greedy_tokens(tiny_model: Path) -> None:
    # NOTE(tests): no drafts, one request alone: the engine runs the prompt in one run, then one row per step
    engine = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=2, intra_op_threads=1,
                                                                 speculative_tokens=0))
    try:
        expected = asyncio.run(_engine_run(engine))
        length = engine.max_model_len
    finally:
        engine.shutdown()
    for batch in (1, 2):
        bare = ceiling.BareLoop(tiny_model, batch, 1, length)
        first = bare.prefill(PROMPT)
        rate = bare.decode(first, len(PROMPT), STEPS)
        assert rate > 0
        for row in range(batch):
            got = [int(first[row])] + bare.tokens[row].tolist()
            if batch == 1:  # NOTE(tests): exact: the same row counts as the engine's lone request
                assert got == list(expected.tokens), f"batch {batch}, row {row}"
    assert not np.array_equal(bare.tokens[0], np.full(STEPS, bare.tokens[0, 0])), "a degenerate (constant) run"
    # batch 2 decodes two rows per run, the engine's lone request one: equal up to a near-tie (tests/greedy_close.py)
    bare = ceiling.BareLoop(tiny_model, 2, 1, length)
    first = bare.prefill(PROMPT)
    assert first.tolist() == [expected.tokens[0]] * 2  # NOTE(tests): exact: each prompt runs alone, as the engine's
    bare.begin(first, len(PROMPT))
    rows = []
    for _ in range(STEPS):
        bare.step()
        rows.append(bare.last_logits.copy())
    later = GreedyRun(expected.tokens[1:], expected.top[1:])
    for row in range(2):
        assert_greedy_close(later, GreedyRun.from_logits([r[row] for r in rows]), TINY_MAX_GAP_NATS,
                            f"batch 2, row {row}")


def _pace(info: StepInfo) -> None:
    if info.kind == "decode":
        time.sleep(0.005)


def test_ceiling_cli_writes_its_figures(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: the engine's decode steps are paced (a test-only fault injector sleeping 5 ms before each): the
    # batch-2 run's first request then lasts 0.24 s at least, so the second one, added by the event loop
    # right after it, always decodes beside it, however fast the machine runs the tiny model.
    monkeypatch.setattr("engine.config.EngineConfig", functools.partial(EngineConfig, fault_injector=_pace))
    out, png = tmp_path / "ceiling.json", tmp_path / "ceiling.png"
    assert ceiling.main(["--model", str(tiny_model), "--batch", "1,2", "--threads", "1", "--rounds", "1",
                         "--prompt-tokens", "8", "--output-tokens", "48", "--json", str(out),
                         "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert set(data["median"]) == {"bare_b1", "engine_b1", "bare_b2", "engine_b2"}
    assert all(v > 0 for v in data["median"].values())
    assert set(data["scaling"]["2"]) == {"bare", "engine"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
