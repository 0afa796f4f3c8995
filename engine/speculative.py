"""Prompt-lookup drafts for speculative decoding: an n-gram index over one request's tokens, and the
adaptive draft length that backs off when drafts are rejected.

Pure Python (the scheduler asks for drafts; the sampler verifies them: RequestSampler.verify); no numpy,
no onnxruntime.

NOTE(engine): prompt lookup decoding (Saxena 2023; vLLM's "ngram" proposer, transformers'
``prompt_lookup_num_tokens``): the last few tokens are looked up among the earlier ones (prompt and output),
and what followed them there is the draft. The model checks the last token and the draft in one run and
keeps the longest prefix it agrees with, plus its own next token. It pays when answers copy their input
(code edits, rewrites, quotes, extraction) and costs one longer run per rejected draft otherwise.

NOTE(engine): the downside is bounded by time, whatever the model writes or the device charges for a check
(llama.cpp's --draft-p-min and vLLM stop drafting where drafts don't pay; here by the numbers): ``CheckCost`` holds
what a check of d draft tokens costs on this device in decode steps, measured by the core; a request drafts when
its own acceptance rate makes a draft pay at that cost, and otherwise only tries again (a one-token probe) out of a
credit that grows by ``PROBE_SHARE`` of a decode step per plain step, so failed probes cost at most that share of
its time (on CUDA a check ran 3-10x a captured decode step, and a model whose drafts never hit was 9x slower with
drafts under a step-counted back-off: docs/perf/GPU.md).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

# n-gram sizes tried, longest first: a longer match predicts better; 1-grams (a single common token such as
# " the") match almost everywhere and draft noise.
MAX_NGRAM = 3
MIN_NGRAM = 2
# After a draft with no token accepted the request drafts nothing for 1, 3, 7, ... steps (capped): on free
# text a lookup often matches something the model doesn't continue, and each such verify run costs more
# than the plain decode step it replaces.
MAX_SKIP_STEPS = 32
# A request whose drafts don't pay at the measured cost probes (one token) only out of a credit of this share of a
# decode step per plain step: its failed probes take at most ~PROBE_SHARE of its time.
PROBE_SHARE = 1.0 / 32
# Weight of the newest measurement in the check and draft times (a new shape's first run may be slow once).
COST_WEIGHT = 0.3
# NOTE(engine): the plain decode step every cost is priced in is the median of the last DECODE_WINDOW lone decode steps
# (a GPU's first run of a shape captures its graph: one step of ~100x). A server whose rows draft from their first step
# would never measure one (its costs stayed the CPU's priors: on an H100 a 0.5B draft's token costs ~1.5 target steps
# where the prior says 0.4), so while fewer than MIN_DECODE_SAMPLES are known, or the newest is DECODE_REFRESH_S old,
# the draft model's rows get a plain step (``CheckCost.wants_decode_sample``, ``choose_drafts``).
DECODE_WINDOW = 8
MIN_DECODE_SAMPLES = 3
DECODE_REFRESH_S = 10.0
MAX_TABLE = 17  # CheckCost's table of check costs by draft length starts this long
# NOTE(engine): a check of S tokens costs about 1 + CHECK_COST_PER_TOKEN * (S - 1) decode steps (measured on
# SmolLM2-135M INT4, 2 cores: 1.29x at S = 2, 1.75x at 4, 2.82x at 8, 4.5x at 16). With a per-token acceptance
# rate a, a draft of d tokens yields 1 + a + a^2 + ... + a^d tokens per check; the draft length is the d that
# maximizes tokens per decode step's worth of time, and 0 (no draft) unless that beats plain decoding by
# MIN_GAIN. a is estimated from the request's own checks, starting from PRIOR (accepted, tested): a fresh
# request drafts 1 token, and the length grows as its drafts keep being accepted (copied text: up to
# max_tokens), or stays short where they aren't (free text).
CHECK_COST_PER_TOKEN = 0.25
# A draft model's token before any measurement, in decode steps of the target: a 0.5B draft beside a 1.5B target reads
# ~40% of its bytes per run (CPU runs are bound by them).
DRAFT_COST_PER_TOKEN = 0.4
# NOTE(engine): a draft's first token costs more than the others: the row catches up first (after a check that kept the
# whole draft, a chunk of 2 tokens: its last draft token and the target's own, ~2 draft runs on the 2-core CPU), and a
# row that resumes drafting after plain steps catches up all the tokens the target added meanwhile (a chunk of ~5-65
# tokens, ~3 runs). Before any measurement: these many draft tokens' worth.
DRAFT_FIRST_TOKENS = 2.0
DRAFT_RESUME_PER_TOKEN = 0.05  # a resume's catch-up per token beyond the steady 2, in decode steps (before measured)
MIN_GAIN = 0.05
# NOTE(engine): a lookup's misses come in runs (the copied text ended: a code edit's changed line, the end of a quoted
# function), where the acceptance estimate, built up over the copy, still pays for long drafts for a few checks: on
# the 1.5B's code edits, checks of 10-12 tokens with none kept, each ~3 decode steps on 2 cores. So a check that kept
# k of its tokens caps the next draft at k + 1 (a kept one first), and each check kept whole doubles the cap again
# (1, 2, 4, 8, ...: a copy that goes on is back at long drafts within a few checks), below what the estimate pays.
CAP_GROWTH = 2
PRIOR = (0.5, 1.0)
DECAY = 0.8  # weight of earlier checks against the newest one
MEMORY_TOKENS = 16.0  # the estimate remembers about this many tested tokens (it follows the text as it changes)


class CheckCost:
    """What a draft check costs against the plain decode step it replaces, as measured on this device (engine-wide,
    owned by the scheduler; the core records each lone decode step and each check).

    Before any measurement a check of d tokens is taken to cost ``1 + CHECK_COST_PER_TOKEN * d`` decode steps (the
    CPU's law); once both kinds are measured, a length's own average is used, a length between two measured ones is
    interpolated, and one beyond them adds ``CHECK_COST_PER_TOKEN`` per token to the nearest (on a GPU a check's time
    hardly grows with its length: 1B, 2 tokens ~2.5 decode steps, 17 ~3; docs/perf/GPU.md). Never less than one decode step.
    """

    def __init__(self) -> None:
        self.decode_s: float | None = None  # median seconds of recent lone decode steps (rows <= speculative_max_batch)
        self._decode_samples: deque[float] = deque(maxlen=DECODE_WINDOW)
        self.decode_at: float | None = None  # time.monotonic() of the newest one
        self.check_s: dict[int, float] = {}  # draft length -> average seconds of its check
        self._table: list[float] = []  # steps(d) for d < len, rebuilt after a check (not after each decode step)
        self._table_decode_s: float | None = None
        self.frozen = False  # keep the prior law whatever this machine measures (freeze())
        self.draft_token_s: float | None = None  # average seconds of a draft model's later token (decode runs, per row)
        self.draft_first_s: float | None = None  # average seconds to a row's first draft token (steady catch-up)
        self.resume_token_s: float | None = None  # average seconds per token of a longer catch-up, beyond the first 2

    def freeze(self) -> None:
        """Ignore measurements from now on: checks cost ``1 + CHECK_COST_PER_TOKEN * d`` decode steps whatever the
        clock says. For tests and probes that count drafts, which must not depend on how loaded the machine is.
        """
        self.frozen = True
        self.decode_s, self.check_s, self._table, self._table_decode_s = None, {}, [], None
        self._decode_samples.clear()
        self.decode_at = None
        self.draft_token_s = self.draft_first_s = self.resume_token_s = None

    def record_decode(self, seconds: float) -> None:
        if self.frozen:
            return
        self._decode_samples.append(seconds)
        self.decode_at = time.monotonic()
        self.decode_s = statistics.median(self._decode_samples)
        if self._table_decode_s is not None and abs(self.decode_s - self._table_decode_s) > 0.05 * self._table_decode_s:
            self._table = []  # NOTE(engine): rebuilt only when the decode time moved by 5%: this runs every step

    def wants_decode_sample(self, now: float | None = None) -> bool:
        """Whether a lone plain decode step should be measured before the next draft (see DECODE_WINDOW); never when
        frozen."""
        if self.frozen:
            return False
        if len(self._decode_samples) < MIN_DECODE_SAMPLES or self.decode_at is None:
            return True
        return (time.monotonic() if now is None else now) - self.decode_at > DECODE_REFRESH_S

    def record_draft(self, first_s: float, num_rows: int, later_s: float, num_later: int) -> None:
        """A draft model's proposal: ``num_rows`` rows got their first draft token in ``first_s`` seconds together
        (their catch-up chunks of at most a few tokens, or their share of the first decode run), and ``num_later``
        later tokens took ``later_s`` (decode runs of every drafting row)."""
        if self.frozen:
            return
        if num_rows > 0:
            self.draft_first_s = _average(self.draft_first_s, first_s / num_rows)
        if num_later > 0:
            self.draft_token_s = _average(self.draft_token_s, later_s / num_later)

    def record_resume(self, seconds: float, num_tokens: int) -> None:
        """A row caught up ``num_tokens`` tokens (more than a steady draft's 2: the target added them while it did not
        draft, or a new prompt) in one chunk of ``seconds``."""
        if self.frozen or num_tokens <= 2:
            return
        first = self.draft_first_s if self.draft_first_s is not None else 0.0
        self.resume_token_s = _average(self.resume_token_s, max(0.0, seconds - first) / (num_tokens - 2))

    def draft_steps(self, num_tokens: int) -> float:
        """A draft model's ``num_tokens`` tokens in decode steps of the target: the first (a catch-up), then the rest
        (a decode run each)."""
        if num_tokens <= 0:
            return 0.0
        token = DRAFT_COST_PER_TOKEN if self.decode_s is None or self.draft_token_s is None else \
            self.draft_token_s / self.decode_s
        first = DRAFT_FIRST_TOKENS * token if self.decode_s is None or self.draft_first_s is None else \
            self.draft_first_s / self.decode_s
        return first + token * (num_tokens - 1)

    def resume_steps(self, num_tokens: int) -> float:
        """What a row that resumes drafting ``num_tokens`` tokens behind pays beyond ``draft_steps`` (its longer
        catch-up), in decode steps of the target."""
        if num_tokens <= 2:
            return 0.0
        if self.resume_token_s is None or self.decode_s is None:
            return DRAFT_RESUME_PER_TOKEN * (num_tokens - 2)
        return self.resume_token_s / self.decode_s * (num_tokens - 2)

    def record_check(self, num_draft: int, seconds: float) -> None:
        if self.frozen:
            return
        old = self.check_s.get(num_draft)
        self.check_s[num_draft] = seconds if old is None else (1 - COST_WEIGHT) * old + COST_WEIGHT * seconds
        self._table = []

    def steps(self, num_draft: int) -> float:
        """A check of ``num_draft`` tokens in decode steps (>= 1)."""
        if num_draft >= len(self._table):
            self._build(max(num_draft + 1, 2 * len(self._table), MAX_TABLE))
        return self._table[num_draft]

    def _build(self, size: int) -> None:
        decode, known = self.decode_s, sorted(self.check_s)
        self._table_decode_s = decode
        if decode is None or not known:
            self._table = [1.0 + CHECK_COST_PER_TOKEN * d for d in range(size)]
            return
        table, i = [], 0
        for d in range(size):
            while i < len(known) and known[i] < d:
                i += 1
            if i < len(known) and known[i] == d:
                cost = self.check_s[d] / decode
            elif i == 0:  # below every measured length
                cost = self.check_s[known[0]] / decode - CHECK_COST_PER_TOKEN * (known[0] - d)
            elif i == len(known):  # beyond them
                cost = self.check_s[known[-1]] / decode + CHECK_COST_PER_TOKEN * (d - known[-1])
            else:  # between two
                lo, hi = known[i - 1], known[i]
                f = (d - lo) / (hi - lo)
                cost = ((1 - f) * self.check_s[lo] + f * self.check_s[hi]) / decode
            table.append(max(1.0, cost))
        self._table = table


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - COST_WEIGHT) * old + COST_WEIGHT * new


def updated_estimate(accepted: float, tested: float, num_drafted: int, num_accepted: int) -> tuple[float, float]:
    """A source's (accepted, tested) token counts after a check that kept ``num_accepted`` of ``num_drafted`` tokens
    (the first rejected one counts as tested): older checks decay by DECAY, and the memory holds MEMORY_TOKENS."""
    accepted = DECAY * accepted + num_accepted
    tested = DECAY * tested + num_accepted + (num_accepted < num_drafted)
    if tested > MEMORY_TOKENS:
        accepted *= MEMORY_TOKENS / tested
        tested = MEMORY_TOKENS
    return accepted, tested


class NgramDrafter:
    """Drafts for one request from its own tokens; owned by the scheduler (core thread only).

    Usage::

        drafter = NgramDrafter(max_tokens=16)
        draft = drafter.propose(request.prompt_ids, request.output_ids, limit=remaining)
        ...  # verify; n of the len(draft) tokens were accepted
        drafter.record(len(draft), n)

    Args:
        max_tokens: the most tokens one draft holds (``--speculative-tokens``).
        min_ngram / max_ngram: n-gram sizes looked up (longest first).
        prior: (accepted, tested) token counts the acceptance rate starts from.
        cost: the device's check cost (shared by the scheduler's drafters); None: the prior law alone.
    """

    def __init__(self, max_tokens: int, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM,
                 prior: tuple[float, float] = PRIOR, cost: CheckCost | None = None) -> None:
        if max_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need max_tokens >= 1 and 1 <= min_ngram <= max_ngram, got {max_tokens}, "
                             f"{min_ngram}, {max_ngram}")
        self.max_tokens = max_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.num_drafted = 0
        self.num_accepted = 0
        self._prior = prior  # (accepted, tested) before any check
        self._accepted, self._tested = prior  # decayed counts behind the acceptance rate
        self._tokens: list[int] = []
        self._num_output = 0  # output tokens already copied into _tokens
        # n-gram -> the index of the token that followed its latest occurrence (whose continuation exists)
        self._next: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # _tokens[:_num_indexed] have their preceding n-grams indexed
        self._skip = 0
        self._misses = 0
        self._cap = max_tokens  # the longest next draft (CAP_GROWTH): what the last checks kept, growing
        self.cost = cost or CheckCost()
        self._credit = 0.0  # decode steps' worth a probe may spend
        self._probe_cost = 0.0  # what the probe being checked took from the credit
        self.num_probes = 0
        self.stopped = False  # for good (``stop``)

    @property
    def acceptance_rate(self) -> float:
        """The estimated chance that the next draft token is accepted (given the ones before it were)."""
        return self._accepted / self._tested

    @property
    def num_tokens(self) -> int:
        """The draft length the acceptance rate pays for now (0: none)."""
        return best_draft_length(self.acceptance_rate, self.max_tokens, self.cost.steps)

    def stop(self) -> None:
        """Draft nothing more (the request's logits are not finite: its choices, the host's and the device's
        argmax over NaN, need not agree, so a check would only cost)."""
        self.stopped = True

    def propose(self, prompt_ids: Sequence[int], output_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """A draft of at most ``min(limit, num_tokens)`` tokens to follow ``prompt_ids + output_ids``, or ()."""
        if not self._tokens:
            self._tokens = list(prompt_ids)
        if len(output_ids) > self._num_output:
            self._tokens.extend(output_ids[self._num_output:])
            self._num_output = len(output_ids)
        self._index()
        if self.stopped:
            return ()
        if self._skip > 0:
            self._skip -= 1
            self._earn()
            return ()
        start = self._match()
        if start is None or limit <= 0:  # NOTE(engine): nothing to draft: no cost model consulted (every step)
            self._earn()
            return ()
        num = min(limit, self.num_tokens, self._cap)
        probing = num <= 0
        if probing:  # NOTE(engine): drafts don't pay now: try one token only out of the probe credit
            probe = self.cost.steps(1) - 1.0  # what a failed one-token check costs beyond the decode step
            if self.num_probes and self._credit < probe:  # (a request's first probe is free)
                self._earn()
                return ()
            num = 1
            if self.num_probes:
                self._credit -= probe
            self._probe_cost = probe  # given back if the probe is kept (record): the first one's too
            self.num_probes += 1
        return self._draft(start, num)

    def lookup(self, limit: int) -> tuple[int, ...]:
        """What a draft of ``limit`` tokens would be now (the tokens ``propose`` last saw), or (): no side effects
        (a lookup scored against another source's check: ``record_shadow``)."""
        start = self._match() if limit > 0 and not self.stopped else None
        return () if start is None else self._draft(start, limit)

    def record_shadow(self, draft: Sequence[int], tokens: Sequence[int]) -> None:
        """Learn from ``draft``, a ``lookup`` this request did not check, against the ``tokens`` its check emitted
        (another source's): the estimate only, as a check of it would have (tested no further than that check got).
        A kept token ends the lookup's back-off."""
        draft = draft[:len(tokens)]
        if not draft:
            return
        kept = 0
        while kept < len(draft) and draft[kept] == tokens[kept]:
            kept += 1
        self._accepted, self._tested = updated_estimate(self._accepted, self._tested, len(draft), kept)
        self._update_cap(len(draft), kept)
        if kept:
            self._misses, self._skip = 0, 0

    def _update_cap(self, num_drafted: int, num_accepted: int) -> None:
        """After a check: kept whole, the cap grows by CAP_GROWTH; else the next draft is at most one past what was
        kept."""
        if num_accepted >= num_drafted:
            self._cap = min(self.max_tokens, max(self._cap, num_drafted) * CAP_GROWTH)
        else:
            self._cap = num_accepted + 1

    def _earn(self) -> None:
        """A plain decode step: the probe credit grows (capped at about one probe's worth)."""
        self._credit = min(self._credit + PROBE_SHARE, self.cost.steps(1) - 1.0 + PROBE_SHARE)

    def _match(self) -> int | None:
        """Where what followed the latest earlier occurrence of the longest n-gram ending the tokens starts, or None."""
        tokens = self._tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is not None:
                return start
        return None

    def _draft(self, start: int, limit: int) -> tuple[int, ...]:
        tokens = self._tokens
        draft = tokens[start:start + limit]
        # NOTE(engine): a match near the end (a loop: "a b c a b c") runs into the draft itself
        while len(draft) < limit:
            draft.append(draft[start + len(draft) - len(tokens)])
        return tuple(draft)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Learn from a check: ``num_accepted`` of ``num_drafted`` tokens kept. The first rejected token (if any)
        counts as tested; a check with nothing accepted also pauses drafting for 1, 3, 7, ... steps; a probe kept
        whole gives its credit back."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if self._probe_cost and num_accepted == num_drafted:
            # NOTE(engine): a kept probe is evidence, not a loss to bound: the next one may follow at once, so a request
            # whose text copies reaches the acceptance that pays for long drafts in a few steps (at a probe per
            # 1 / PROBE_SHARE steps it took longer than a 128-token answer: 1.3x instead of 3.5x on the H200)
            self._credit += self._probe_cost
        self._probe_cost = 0.0
        self._accepted, self._tested = updated_estimate(self._accepted, self._tested, num_drafted, num_accepted)
        self._update_cap(num_drafted, num_accepted)
        if num_accepted == 0:
            self._misses += 1
            self._skip = min(2 ** self._misses - 1, MAX_SKIP_STEPS)
        else:
            self._misses = 0

    def _index(self) -> None:
        """Index the n-grams that end just before each token not yet indexed (their continuation)."""
        tokens = self._tokens
        for i in range(max(self._num_indexed, self.min_ngram), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                self._next[tuple(tokens[i - n:i])] = i
        self._num_indexed = len(tokens)


def best_draft_length(acceptance_rate: float, max_tokens: int, steps: Callable[[int], float] | None = None) -> int:
    """The draft length d in [1, max_tokens] with the most expected tokens per decode step's worth of time,
    ``(1 + a + ... + a^d) / steps(d)`` (default ``1 + CHECK_COST_PER_TOKEN * d``, ``CheckCost.steps`` where
    measured); 0 when even the best doesn't beat 1 + MIN_GAIN."""
    best, best_gain = 0, 1.0 + MIN_GAIN
    expected, power = 1.0, 1.0
    for d in range(1, max_tokens + 1):
        power *= acceptance_rate
        expected += power
        gain = expected / (steps(d) if steps is not None else 1.0 + CHECK_COST_PER_TOKEN * d)
        if gain > best_gain:
            best, best_gain = d, gain
    return best
