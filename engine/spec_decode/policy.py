"""Which source drafts for a row, and how many tokens: the draft model's per-request state (acceptance estimate,
back-off) and the expected gain of each source at the device's measured costs. Pure Python (the scheduler's).

NOTE(engine): a draft of d tokens whose tokens are each kept with probability a (given the ones before were) yields
``1 + a + ... + a^d`` tokens per check. Prompt lookup drafts cost nothing to make, so a check of d tokens costs
``steps(d)`` decode steps (``engine.speculative.CheckCost``); a draft model's d tokens cost its runs besides,
``draft_steps(d)`` decode steps of the target (measured: ``CheckCost.record_draft``): the first token costs the row's
catch-up (a 2-token chunk after a check kept whole: ~2 draft runs), each later one a decode run, and a row that did
not draft last step first catches up every token since (``resume_steps``). Each step takes the source with the most
tokens per decode step's worth of time, and neither where neither beats plain decoding; while the draft model drafts,
what prompt lookup would have drafted is scored against its checks (``NgramDrafter.record_shadow``), so a text that
copies its input moves to the drafts that cost nothing to make.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from engine.spec_decode.proposer import DraftRow, NgramProposer
from engine.speculative import MIN_GAIN, CheckCost, NgramDrafter, updated_estimate

log = logging.getLogger(__name__)

# A same-family draft model's tokens are kept ~70% of the time on free text (greedy), more on code; the estimate starts
# there as if 2 tokens had been tested, and follows the request's own checks.
MODEL_PRIOR = (1.4, 2.0)
# A row whose draft-model drafts don't pay probes (a short draft) only out of a credit that grows by PROBE_SHARE of a
# decode step per plain step; a probe takes what it costs beyond a plain step, its catch-up included
# (``CheckCost.resume_steps``), and gets back a step for each of its tokens kept: probes take ~PROBE_SHARE of the time.
PROBE_SHARE = 1.0 / 24
PROBE_TOKENS = 2
# A request's first probe is free unless its catch-up (the prompt, in the draft row) costs more decode steps than this,
# and more than FREE_PROBE_SHARE of the answer it could speed up (its tokens left, at most FREE_PROBE_HORIZON).
# NOTE(engine): the catch-up is paid once: a probe kept whole leaves the row in step, and its later drafts pay no
# catch-up. Charged to the probe alone, a code edit's 253-token prompt (~15 steps on the 2-core CPU) kept the draft
# model silent for its whole 128-token answer, whose tokens the 0.5B predicts 99.6% of the time (docs/perf/
# speculative.md); an agent's 10,000-token prompt (hundreds of steps) still waits for the credit like any probe.
FREE_PROBE_STEPS = 4.0
FREE_PROBE_SHARE = 0.15
FREE_PROBE_HORIZON = 256
# NOTE(engine): whether a row drafts follows what its draft-model drafts gave: tokens per decode step's worth of time
# over its recent checks (each weighs GAIN_DECAY of the one after it, at most GAIN_MEMORY_STEPS steps remembered),
# starting from GAIN_PRIOR as if GAIN_PRIOR_STEPS steps had been seen. A drafting row goes on while they beat plain
# steps at all (1.0; a start needs 1 + MIN_GAIN): on the CPU a row that stops rarely starts again (its catch-up grows
# ~0.06 steps a token, faster than the probe credit), so one draft of 11 sure tokens that all missed (~6.5 steps for
# one token) must not stop it. A row behind by a catch-up (a new prompt, steps prompt lookup drafted) catches up when
# the steps its drafts would save over the rest of its answer (at most FREE_PROBE_HORIZON tokens) exceed it. A draft
# goes up to the row's limit and stops where the draft model is unsure (--spec-draft-p-min), as llama.cpp's does.
# The acceptance estimate alone (1 + a + ... + a^d against the costs) turned drafts off after two misses in a row, and
# at the CPU's costs a = 0.7 paid at no length; but on free text the misses come where the draft model is unsure,
# those drafts stop after a token and cost little, and the sure ones are kept whole. Replayed over the bench's answers
# (perf/spec_policy.py): free chat 1.05x -> 1.21x drafts off, JSON 1.63x -> 1.73x, code edits 1.90x -> 1.89x, and a
# text whose drafts are never kept ~0.99x (docs/perf/speculative.md, "The length policy").
GAIN_PRIOR = 1.2
GAIN_DECAY = 0.95
GAIN_MEMORY_STEPS = 48.0
GAIN_PRIOR_STEPS = 32.0


def expected_tokens(acceptance_rate: float, num_draft: int) -> float:
    """Tokens a check of ``num_draft`` tokens yields on average: ``1 + a + ... + a^d``."""
    total, power = 1.0, 1.0
    for _ in range(num_draft):
        power *= acceptance_rate
        total += power
    return total


def best_length(acceptance_rate: float, max_tokens: int, cost: Callable[[int], float]) -> tuple[int, float]:
    """``(d, gain)``: the draft length in [1, max_tokens] with the most tokens per decode step's worth of time
    ``expected_tokens(a, d) / cost(d)``, and that gain; ``(0, 1.0)`` when even the best doesn't beat 1 + MIN_GAIN."""
    best, best_gain = 0, 1.0 + MIN_GAIN
    total, power = 1.0, 1.0
    for d in range(1, max_tokens + 1):
        power *= acceptance_rate
        total += power
        gain = total / cost(d)
        if gain > best_gain:
            best, best_gain = d, gain
    return (best, best_gain) if best else (0, 1.0)


class ModelDraftState:
    """One request's draft-model drafts (scheduler-owned): its acceptance estimate and its probe back-off.

    Usage::

        state = ModelDraftState()
        num, gain = state.plan(limit, cost)  # 0: no draft this step
        ...  # the draft model drafted k <= num tokens, the target kept n of them
        state.record(k, n)
    """

    def __init__(self, prior: tuple[float, float] = MODEL_PRIOR, gain_prior: float = GAIN_PRIOR) -> None:
        self._accepted, self._tested = prior
        self.num_drafts = self.num_drafted = self.num_accepted = self.num_probes = 0
        self._credit = 0.0  # decode steps' worth a probe may spend
        self._probe_cost = 0.0  # what the probe being checked took from the credit (0: not a probe)
        self.drafted_last = False  # the last step drafted (the draft row is caught up but for a token or two)
        self.drafted_at = 0  # the request's tokens when it last drafted (0: never: the draft row lacks the prompt)
        # (tokens, decode steps) of recent drafts, decayed, the prior's among them
        self._gain = (gain_prior * GAIN_PRIOR_STEPS, GAIN_PRIOR_STEPS)
        self._cost: CheckCost | None = None  # the costs the last plan was made at (what record prices a check with)

    @property
    def acceptance_rate(self) -> float:
        return self._accepted / self._tested

    def gain(self, num_draft: int, cost: CheckCost) -> float:
        """Tokens per decode step's worth of a draft of ``num_draft`` tokens from the draft model now."""
        return expected_tokens(self.acceptance_rate, num_draft) / (cost.draft_steps(num_draft) + cost.steps(num_draft))

    def realized_gain(self) -> float:
        """Tokens per decode step's worth of time this row's recent drafts gave (``GAIN_DECAY``; the prior's
        ``gain_prior`` before any)."""
        tokens, steps = self._gain
        return tokens / steps

    def plan(self, limit: int, cost: CheckCost, num_tokens: int = 0, num_left: int = 0) -> tuple[int, float]:
        """``(tokens to draft, expected gain)`` this step, at most ``limit``: ``limit`` while the row's drafts pay
        (``realized_gain``, and its catch-up repaid by the rest of the answer; the draft model stops earlier where it
        is unsure), else a probe now and then (``PROBE_TOKENS``, out of the probe credit), else ``(0, 1.0)``.
        ``num_tokens``: the request's tokens (what a draft row that did not draft lately must catch up); ``num_left``:
        the tokens it may still generate."""
        if limit <= 0:
            return 0, 1.0
        self._cost = cost
        resume = 0.0 if self.drafted_last else cost.resume_steps(num_tokens - self.drafted_at)
        gain = self.realized_gain()
        # (a row drafting goes on while its drafts beat plain steps at all: stopping is for good on the CPU)
        going = self.drafted_last and resume <= 0.0
        if gain >= 1.0 + (0.0 if going else MIN_GAIN) and (
                going or resume <= (1.0 - 1.0 / gain) * min(num_left, FREE_PROBE_HORIZON)):
            self._probe_cost = 0.0
            return limit, gain
        # NOTE(engine): drafts don't pay: a short probe now and then keeps the estimate fresh, out of a credit, so
        # that failed probes (and their catch-ups) cost a bounded share of the time whatever the text
        num = min(PROBE_TOKENS, limit)
        probe = cost.draft_steps(num) + cost.steps(num) + resume - 1.0  # beyond the plain step it replaces
        # (a first probe is free if it catches up little, or little against the answer it could speed up)
        free_steps = max(FREE_PROBE_STEPS, FREE_PROBE_SHARE * min(num_left, FREE_PROBE_HORIZON))
        paid = self.num_probes or resume > free_steps
        if paid and self._credit < probe:
            self._credit = min(self._credit + PROBE_SHARE, probe + PROBE_SHARE)
            self._probe_cost = 0.0
            return 0, 1.0
        if paid:
            self._credit -= probe
        self.num_probes += 1
        self._probe_cost = probe  # (a free one's kept tokens earn credit too: the next may follow)
        return num, self.gain(num, cost)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Learn from a check: ``num_accepted`` of ``num_drafted`` tokens kept (the first rejected one counts as
        tested); a probe gets a decode step back per token kept (its loss is what it cost beyond them)."""
        self.num_drafts += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if self._cost is not None:  # NOTE(engine): a resume's catch-up is left out: it is what stopping cost
            tokens, steps = self._gain
            tokens = GAIN_DECAY * tokens + num_accepted + 1
            steps = GAIN_DECAY * steps + self._cost.draft_steps(num_drafted) + self._cost.steps(num_drafted)
            if steps > GAIN_MEMORY_STEPS:
                tokens, steps = tokens * GAIN_MEMORY_STEPS / steps, GAIN_MEMORY_STEPS
            self._gain = (tokens, steps)
            if log.isEnabledFor(logging.DEBUG):
                c = self._cost
                log.debug("draft check: %d drafted, %d kept, priced %.2f + %.2f steps; decode %s ms, draft token %s ms, "
                          "first %s ms; realized gain %.3f", num_drafted, num_accepted, c.draft_steps(num_drafted),
                          c.steps(num_drafted), _ms(c.decode_s), _ms(c.draft_token_s), _ms(c.draft_first_s),
                          tokens / steps)
        if self._probe_cost:
            self._credit += min(self._probe_cost, float(num_accepted))
        self._probe_cost = 0.0
        self._accepted, self._tested = updated_estimate(self._accepted, self._tested, num_drafted, num_accepted)


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.2f}"


def choose_drafts(decode: Sequence[Any], budget: int, ngram: NgramProposer, ngram_max: int, draft_max: int,
                  cost: CheckCost) -> tuple[list[tuple[Any, tuple[int, ...]]], tuple[DraftRow, ...]]:
    """Each decoding row's draft this step, within ``budget`` draft tokens: ``(prompt-lookup drafts to check, as
    (request, tokens)), (rows the draft model drafts for))``. Each row takes the source with the most expected tokens
    per decode step's worth of time, or none; a request's ``draft_max_tokens`` bounds its own (0: no drafts).
    Creates the rows' drafter states (``NgramDrafter``, ``ModelDraftState``) on first use. ``decode``: the
    scheduler's Requests (not imported here: the scheduler imports this module). With a draft model, none while a
    plain decode step's time is due (``CheckCost.wants_decode_sample``: every cost is priced in it)."""
    checks: list[tuple[Any, tuple[int, ...]]] = []
    rows: list[DraftRow] = []
    if draft_max and cost.wants_decode_sample():
        return checks, ()
    for request in decode:
        asked = request.params.draft_max_tokens
        if asked == 0:
            continue
        # never past max_tokens / the context: the check emits up to len(draft) + 1 tokens
        limit = min(budget, request.max_num_tokens - request.num_tokens - 1)
        if asked is not None:
            limit = min(limit, asked)
        if limit <= 0:
            continue
        draft: tuple[int, ...] = ()
        if ngram_max:
            if request.drafter is None:
                request.drafter = NgramDrafter(ngram_max, cost=cost)
            draft = ngram.propose([DraftRow(request, min(limit, ngram_max))])[0].token_ids
        if draft_max:
            if request.model_draft is None:
                request.model_draft = ModelDraftState()
            num, gain = request.model_draft.plan(min(limit, draft_max), cost, request.num_tokens,
                                                 request.max_num_tokens - request.num_tokens)
            ngram_gain = (expected_tokens(request.drafter.acceptance_rate, len(draft)) / cost.steps(len(draft))
                          if draft else 0.0)
            model = request.model_draft
            if num and gain > ngram_gain:
                rows.append(DraftRow(request, num))
                budget -= num
                model.drafted_last, model.drafted_at = True, request.num_tokens
                # NOTE(engine): what prompt lookup would have drafted is scored against the check's tokens for free,
                # so its estimate follows the text while the draft model drafts (a copy it would draft at no cost)
                request.shadow_draft = request.drafter.lookup(min(limit, ngram_max)) if ngram_max else ()
                continue
            model.drafted_last = False
        if draft:
            checks.append((request, draft))
            budget -= len(draft)
    return checks, tuple(rows)
