"""Batch runs stopped for interactive requests (engine.run_interrupt) on real sessions of the default model: ONNX
Runtime stops a run armed for batch rows when an interactive request arrives, the stopped run's KV writes never
reach a later token, and under a batch load every request's greedy text is the one it has alone (tests/greedy_close.py).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.run_interrupt import RunInterrupted
from engine.types import SamplingParams
from tests.greedy_close import TOP_K, GreedyRun, assert_greedy_close

PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)
QUICK = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)
WRONG_TOKEN = 0  # what a stopped run feeds: a write of it that survived would change every later token


class BatchRunGate:
    """A fault injector (EngineConfig.fault_injector: called on the core thread before each model run) that, once
    ``armed``, holds the first decode run of batch rows only (ids ``b*``) until ``go``, so that an interactive
    request queued meanwhile is registered before that run starts."""

    def __init__(self) -> None:
        self.armed, self.reached, self.go = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, info) -> None:
        if not self.armed.is_set() or self.reached.is_set() or info.kind != "decode":
            return
        if info.request_ids and all(rid.startswith("b") for rid in info.request_ids):
            self.reached.set()
            self.go.wait(60)


def prompt(engine: AsyncEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.chat_template.render([{"role": "user", "content": text}]))


def test_a_stopped_run_leaves_nothing_a_later_token_reads(default_model: Path) -> None:
    """Two prompts greedy-decoded together in rows 0-1, then again in rows 2-3 (the same run shapes: bit-identical on
    the CPU EP) with a stopped run of wrong tokens at the same positions before every real run, stopped at its start
    or midway (a timer thread, as an arriving request would): the tokens are the same."""
    engine = AsyncEngine.from_model_dir(default_model, EngineConfig(max_batch=4, max_queue=8, seed=0))
    try:
        runner = engine._core.runner
        interrupt = runner.interrupt
        prompts = [prompt(engine, "Name four rivers."), prompt(engine, "Count to ten.")]
        num_stopped = 0

        def stopped_first(run, wrong_args: tuple, delay_s: float | None) -> None:
            """``run(*wrong_args)`` as a batch run an interactive arrival stops (``delay_s`` None: before it starts
            computing); a run the timer came too late for counts as not stopped."""
            nonlocal num_stopped
            interrupt.drained()
            timer = threading.Timer(delay_s or 0.0, interrupt.arrived, (0,))
            try:
                with interrupt.batch_run(True):
                    if delay_s is None:
                        interrupt.arrived(0)
                    else:
                        timer.start()
                    run(*wrong_args)
            except RunInterrupted as stop:
                assert stop.started
                num_stopped += 1
            finally:
                if delay_s is not None:
                    timer.join()
                interrupt.drained()

        def greedy(rows: list[int], stop: bool) -> list[list[int]]:
            tokens: list[list[int]] = []
            for i, (row, ids) in enumerate(zip(rows, prompts)):
                if stop:  # a prompt chunk of wrong tokens stopped midway
                    stopped_first(runner.prefill, (row, [WRONG_TOKEN] * len(ids), 0), 0.002 * (i + 1))
                tokens.append([int(np.argmax(runner.prefill(row, ids, 0)))])
            for step in range(12):
                positions = [len(ids) + len(t) - 1 for ids, t in zip(prompts, tokens)]
                if stop:
                    delay = None if step % 3 == 0 else 0.001 * (step % 3) * 3
                    stopped_first(runner.decode, (rows, [WRONG_TOKEN] * len(rows), positions), delay)
                logits = runner.decode(rows, [t[-1] for t in tokens], positions)
                for t, row_logits in zip(tokens, logits):
                    t.append(int(np.argmax(row_logits)))
            return tokens

        ref = greedy([0, 1], stop=False)
        got = greedy([2, 3], stop=True)
    finally:
        engine.shutdown()
    assert num_stopped >= 4  # every fourth decode run at least (stopped before it computes anything)
    assert got == ref


def test_interactive_requests_stop_batch_runs_and_every_text_is_its_own(default_model: Path) -> None:
    """Batch requests (priority 1) fill every row; interactive requests arrive one after another while they decode.
    Batch runs are stopped or skipped for them (counted), and every request's greedy text is its own alone."""
    gate = BatchRunGate()
    engine = AsyncEngine.from_model_dir(default_model, EngineConfig(max_batch=3, max_queue=8, seed=0,
                                                                    fault_injector=gate))
    try:
        batch_texts = ["Name four rivers.", "List three colors.", "Count to ten."]
        interactive_texts = ["Say hi.", "Name a fruit.", "Name a planet.", "Name a month."]
        batch_prompts = [prompt(engine, t) for t in batch_texts]
        interactive_prompts = [prompt(engine, t) for t in interactive_texts]

        async def alone() -> tuple[list[list], list[list]]:
            batch = [[o async for o in engine.generate(p, PARAMS, f"alone-b{i}")] for i, p in enumerate(batch_prompts)]
            quick = [[o async for o in engine.generate(p, QUICK, f"alone-i{i}")]
                     for i, p in enumerate(interactive_prompts)]
            return batch, quick

        async def together() -> tuple[list[list], list[list]]:
            async def run(p: list[int], params: SamplingParams, rid: str, priority: int) -> list:
                return [o async for o in engine.generate(p, params, rid, priority=priority)]

            before = engine.stats().generation_tokens_total
            batch = [asyncio.create_task(run(p, PARAMS, f"b{i}", 1)) for i, p in enumerate(batch_prompts)]
            while engine.stats().generation_tokens_total < before + 9:  # every batch request is decoding
                await asyncio.sleep(0.002)
            # the first arrival waits for a decode run of the batch rows alone and is queued just before it starts
            # (the core holds at the gate meanwhile): that run is skipped, whatever the machine's speed
            gate.armed.set()
            assert await asyncio.to_thread(gate.reached.wait, 60), "no decode run of the batch rows alone"
            first = asyncio.create_task(run(interactive_prompts[0], QUICK, "i0", 0))
            for _ in range(2):  # the task runs up to its first wait, past core.add (no await before it)
                await asyncio.sleep(0)
            gate.go.set()
            quick = [await first]
            for i, p in enumerate(interactive_prompts[1:], start=1):
                await asyncio.sleep(0.01)  # the batch rows run alone again before the next one arrives
                quick.append(await run(p, QUICK, f"i{i}", 0))
            return list(await asyncio.gather(*batch)), quick

        ref_batch, ref_quick = asyncio.run(alone())
        extra = engine.stats().extra
        assert extra["batch_runs_stopped_total"] == extra["batch_runs_skipped_total"] == 0  # nothing to stop alone
        got_batch, got_quick = asyncio.run(together())
        extra = engine.stats().extra
    finally:
        engine.shutdown()
    # NOTE(tests): the first arrival is queued at the gate, before a batch run: that run is skipped; the later ones
    # land in a batch run (stopped), between runs (skipped) or after a step's last run (neither), as timing goes
    assert extra["batch_runs_skipped_total"] >= 1
    for texts, params, refs, gots in ((batch_texts, PARAMS, ref_batch, got_batch),
                                      (interactive_texts, QUICK, ref_quick, got_quick)):
        for text, ref, got in zip(texts, refs, gots):
            assert len([t for o in got for t in o.token_ids]) == params.max_tokens
            assert_greedy_close(GreedyRun.from_engine(ref), GreedyRun.from_engine(got), what=text)
