"""Speculation with a bounded downside: the measured check cost, probes out of a time credit, and requests whose
logits are not finite (engine.speculative, the core's accounting; scripted costs and a scripted runner, no model)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from engine.core import EngineCore
from engine.scheduler import Request, Scheduler
from engine.speculative import PROBE_SHARE, CheckCost, NgramDrafter
from engine.types import SamplingParams


def test_check_cost_starts_from_the_prior_law_and_follows_what_was_measured():
    cost = CheckCost()
    assert cost.steps(4) == pytest.approx(2.0)  # 1 + 0.25 * 4 before any measurement
    cost.record_decode(0.001)
    cost.record_check(4, 0.006)
    assert cost.steps(4) == pytest.approx(6.0)
    assert cost.steps(8) == pytest.approx(6.0 + 0.25 * 4)  # beyond: the nearest plus the prior's cost per token
    assert cost.steps(1) == pytest.approx(6.0 - 0.25 * 3)
    cost.record_check(16, 0.008)
    assert cost.steps(10) == pytest.approx(6.0 + 2.0 * 6 / 12)  # between two measured lengths: interpolated
    cost.record_check(1, 0.0005)  # a check is never taken as cheaper than the step it replaces
    assert cost.steps(1) == 1.0
    cost.record_decode(0.002)  # (the decode step moved by over 5%: every length's cost with it)
    assert cost.steps(4) == pytest.approx(0.006 / 0.0015) and cost.steps(20) > cost.steps(16)  # (the median step)


def test_the_decode_step_is_the_median_of_recent_ones_and_a_draft_model_waits_for_three():
    """A GPU's first run of a shape captures its graph (one step ~100x the others): the step every cost is priced in
    is the median of the recent lone steps, and until three are measured (or the newest is old) the scheduler gives the
    draft model's rows a plain step: rows that draft from their first step never measured one, and their costs stayed
    the CPU's priors."""
    cost = CheckCost()
    assert cost.wants_decode_sample()
    cost.record_decode(0.300)  # a graph capture
    cost.record_decode(0.003)
    assert cost.wants_decode_sample()
    cost.record_decode(0.0031)
    assert not cost.wants_decode_sample() and cost.decode_s == pytest.approx(0.0031)
    assert cost.wants_decode_sample(now=cost.decode_at + 11.0)  # stale: measured again
    cost.freeze()
    assert not cost.wants_decode_sample() and cost.decode_s is None


def simulate(check_steps: float, accepted: bool, num_tokens: int = 2000, per_token: float = 0.0,
             warm: bool = True) -> float:
    """Tokens per decode step's worth of time for one request whose lookups always find a draft, on a device where a
    check of d tokens costs ``check_steps + per_token * d`` decode steps; every draft fully accepted or none."""
    cost = CheckCost()  # measured as the core does: each plain step and each check as it runs
    cost.record_decode(1.0)
    if warm:
        cost.record_check(1, check_steps + per_token)  # (an earlier request's probe)
    drafter = NgramDrafter(max_tokens=16, cost=cost)
    prompt, output = [1, 2, 3] * 8, []
    time = 0.0
    while len(output) < num_tokens:
        draft = drafter.propose(prompt, output, limit=num_tokens - len(output))
        if draft:
            time += check_steps + per_token * len(draft)
            cost.record_check(len(draft), check_steps + per_token * len(draft))
            kept = len(draft) if accepted else 0
            drafter.record(len(draft), kept)
            output += [7] * (kept + 1)  # (what the tokens are does not matter to the lookup of (1, 2, 3) loops)
            output[-kept - 1:] = ([1, 2, 3] * 20)[:kept + 1] if accepted else output[-kept - 1:]
        else:
            time += 1.0
            cost.record_decode(1.0)
            output.append(([1, 2, 3] * 2)[len(output) % 3])
    return len(output[:num_tokens]) / time


@pytest.mark.parametrize("check_steps", [1.3, 3.0, 8.0, 40.0])
def test_drafts_that_never_hit_cost_at_most_the_probe_share(check_steps):
    # NOTE: 40 decode steps a check is what cuDNN's per-shape plans cost an unpinned CUDA session (docs/perf/GPU.md)
    assert simulate(check_steps, accepted=False) >= 1.0 - 2 * PROBE_SHARE


@pytest.mark.parametrize("check_steps, at_least", [(1.3, 4.0), (3.0, 3.0), (6.0, 1.8)])
def test_drafts_that_hit_pay_on_a_device_where_a_check_costs_several_steps(check_steps, at_least):
    assert simulate(check_steps, accepted=True, per_token=0.05) >= at_least


@pytest.mark.parametrize("check_steps", [2.5, 3.0])
def test_short_answers_that_copy_reach_long_drafts_within_the_answer(check_steps):
    # NOTE: 128 tokens, a check ~3 decode steps whatever its length (H200, 1B): kept probes follow each other at once
    assert simulate(check_steps, accepted=True, num_tokens=128, per_token=0.03) >= 1.8


def test_a_fresh_request_probes_once_even_where_checks_are_dear():
    cost = CheckCost()
    cost.record_decode(1.0)
    cost.record_check(1, 20.0)
    drafter = NgramDrafter(max_tokens=16, cost=cost)
    assert drafter.num_tokens == 0  # drafts can't pay at that cost with the prior acceptance
    assert drafter.propose([1, 2, 3, 1, 2], [], limit=99) == (3,)  # but the first probe is free
    drafter.record(1, 0)
    probes = sum(bool(drafter.propose([1, 2, 3, 1, 2], [], limit=99)) for _ in range(1000))
    assert probes <= 1000 * PROBE_SHARE / 19.0 + 1  # then one per 19 / PROBE_SHARE plain steps


# -- the core: non-finite logits ---------------------------------------------------------------------------


class ScriptedRunner:
    """A model on the host: the next token follows the last one by ``(5 t + 3) mod V`` (greedy output cycles, so
    prompt-lookup drafts hit); every position from ``nan_from`` on gives NaN logits."""

    vocab_size = 16
    can_batch_prompts = False
    max_batched_prompt = 0
    decode_summary = None
    run_log = None
    buckets = (1,)

    def __init__(self, nan_from: int | None = None) -> None:
        self.nan_from = nan_from
        self.verify_runs = 0

    def _row(self, token: int, position: int) -> np.ndarray:
        row = np.zeros(self.vocab_size, dtype=np.float32)
        if self.nan_from is not None and position >= self.nan_from:
            row[:] = np.nan
        else:
            row[(5 * token + 3) % self.vocab_size] = 1.0
        return row

    def decode(self, slots, token_ids, positions, logits=True):
        return np.stack([self._row(t, p) for t, p in zip(token_ids, positions)])

    def verify(self, slot, token_ids, start):
        self.verify_runs += 1
        return np.stack([self._row(t, start + i) for i, t in enumerate(token_ids)])

    def prefill(self, slot, token_ids, start, also=()):
        return self._row(token_ids[-1], start + len(token_ids) - 1)

    def copy_kv(self, src, dst, start, end):
        pass

    def release(self, slot, keep=0):
        pass


def run_core(runner: ScriptedRunner, prompts: list[list[int]], max_tokens: int = 40) -> dict[str, list[int]]:
    scheduler = Scheduler(num_slots=2, max_waiting=8, token_budget=64, speculative_tokens=4)
    outputs: dict[str, list[int]] = {}
    core = EngineCore(runner, scheduler, lambda outs: [outputs.setdefault(o.request_id, []).extend(o.token_ids)
                                                       for o in outs], seed=0)
    for i, prompt in enumerate(prompts):
        core._add(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          max_model_len=256))
    while scheduler.has_work:
        core.step()
    return outputs


def test_drafts_hit_on_the_scripted_model_and_give_the_plain_tokens():
    plain = run_core(ScriptedRunner(), [[1, 2, 3]])
    runner = ScriptedRunner()
    core_tokens = run_core(runner, [[1, 2, 3]])
    assert core_tokens == plain and len(plain["r0"]) == 40
    assert runner.verify_runs > 0


def test_non_finite_logits_stop_drafts_and_are_reported_once(caplog):
    runner = ScriptedRunner(nan_from=12)
    with caplog.at_level(logging.WARNING, logger="engine.core"):
        outputs = run_core(runner, [[1, 2, 3], [4, 5, 6]])
    assert all(len(tokens) == 40 for tokens in outputs.values())  # the requests run to the end
    warnings = [r for r in caplog.records if "not finite" in r.getMessage()]
    assert len(warnings) == 1
    checks_before = runner.verify_runs
    # past position 12 every choice is NaN: no request checks a draft there (a scripted NaN run from the start)
    runner = ScriptedRunner(nan_from=0)
    run_core(runner, [[1, 2, 3]])
    assert runner.verify_runs == 0 and checks_before < 10
