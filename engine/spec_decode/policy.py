"""Which source drafts for a row, and how many tokens: the draft model's per-request state (acceptance estimate,
back-off) and the expected gain of each source at the device's measured costs. Pure Python (the scheduler's).

NOTE(engine): a draft of d tokens whose tokens are each kept with probability a (given the ones before were) yields
``1 + a + ... + a^d`` tokens per check. Prompt lookup drafts cost nothing to make, so a check of d tokens costs
``steps(d)`` decode steps (``engine.speculative.CheckCost``); a draft model's d tokens cost d runs of the draft model
besides, ``draft_steps(d)`` decode steps of the target (measured: ``CheckCost.record_draft``). Each step takes the
source with the most tokens per decode step's worth of time, and neither where neither beats plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.spec_decode.proposer import DraftRow, NgramProposer
from engine.speculative import DECAY, MEMORY_TOKENS, MIN_GAIN, CheckCost, NgramDrafter

# A same-family draft model's tokens are kept ~70% of the time on free text (greedy), more on code; the estimate starts
# there as if 2 tokens had been tested, and follows the request's own checks.
MODEL_PRIOR = (1.4, 2.0)
# A row whose draft-model drafts don't pay probes (a short draft) after this many plain steps, doubling after each
# failed probe up to MAX_PROBE_INTERVAL and back to the first interval once a probe is kept whole.
PROBE_INTERVAL = 4
MAX_PROBE_INTERVAL = 64
PROBE_TOKENS = 2


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

    def __init__(self, prior: tuple[float, float] = MODEL_PRIOR) -> None:
        self._accepted, self._tested = prior
        self.num_drafts = self.num_drafted = self.num_accepted = 0
        self._wait = 0  # plain steps before the next probe
        self._interval = PROBE_INTERVAL
        self._probing = False

    @property
    def acceptance_rate(self) -> float:
        return self._accepted / self._tested

    def gain(self, num_draft: int, cost: CheckCost) -> float:
        """Tokens per decode step's worth of a draft of ``num_draft`` tokens from the draft model now."""
        return expected_tokens(self.acceptance_rate, num_draft) / (cost.draft_steps(num_draft) + cost.steps(num_draft))

    def plan(self, limit: int, cost: CheckCost) -> tuple[int, float]:
        """``(tokens to draft, expected gain)`` this step, at most ``limit``: the best length, else a probe now and
        then (``PROBE_TOKENS``), else ``(0, 1.0)``."""
        if limit <= 0:
            return 0, 1.0
        num, gain = best_length(self.acceptance_rate, limit,
                                lambda d: cost.draft_steps(d) + cost.steps(d))
        if num:
            self._probing = False
            return num, gain
        if self._wait > 0:  # NOTE(engine): drafts don't pay: a short probe now and then keeps the estimate fresh
            self._wait -= 1
            return 0, 1.0
        self._probing = True
        num = min(PROBE_TOKENS, limit)
        return num, self.gain(num, cost)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Learn from a check: ``num_accepted`` of ``num_drafted`` tokens kept (the first rejected one counts as
        tested)."""
        self.num_drafts += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        tested = num_accepted + (num_accepted < num_drafted)
        self._accepted = DECAY * self._accepted + num_accepted
        self._tested = DECAY * self._tested + tested
        if self._tested > MEMORY_TOKENS:
            self._accepted *= MEMORY_TOKENS / self._tested
            self._tested = MEMORY_TOKENS
        if self._probing:
            self._probing = False
            if num_drafted and num_accepted == num_drafted:
                self._interval = PROBE_INTERVAL
            else:
                self._interval = min(2 * self._interval, MAX_PROBE_INTERVAL)
            self._wait = self._interval


def choose_drafts(decode: Sequence[Any], budget: int, ngram: NgramProposer, ngram_max: int, draft_max: int,
                  cost: CheckCost) -> tuple[list[tuple[Any, tuple[int, ...]]], tuple[DraftRow, ...]]:
    """Each decoding row's draft this step, within ``budget`` draft tokens: ``(prompt-lookup drafts to check, as
    (request, tokens)), (rows the draft model drafts for))``. Each row takes the source with the most expected tokens
    per decode step's worth of time, or none; a request's ``draft_max_tokens`` bounds its own (0: no drafts).
    Creates the rows' drafter states (``NgramDrafter``, ``ModelDraftState``) on first use. ``decode``: the
    scheduler's Requests (not imported here: the scheduler imports this module)."""
    checks: list[tuple[Any, tuple[int, ...]]] = []
    rows: list[DraftRow] = []
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
            num, gain = request.model_draft.plan(min(limit, draft_max), cost)
            ngram_gain = (expected_tokens(request.drafter.acceptance_rate, len(draft)) / cost.steps(len(draft))
                          if draft else 0.0)
            if num and gain > ngram_gain:
                rows.append(DraftRow(request, num))
                budget -= num
                continue
        if draft:
            checks.append((request, draft))
            budget -= len(draft)
    return checks, tuple(rows)
