"""Drafts from a second, smaller model of the same vocabulary: its own runner and KV rows (one per slot of the target),
driven by the core. All rows that draft this step go through batched decode runs of the draft model.

Imports numpy; the runner it drives imports onnxruntime (built in ``engine.placement``).

NOTE(engine): the draft row of a slot holds KV for ``_held[slot]``, tokens of whichever request last drafted there.
Before a draft, the row is brought up to its request's tokens: the longest common prefix stays, the rest (a new
prompt, the tokens the target added since the row last drafted, the last token) runs as one chunk in the row, whose
last position gives the first draft token; the others come from decode runs of every drafting row together. A KV
copy between the target's slots (prefix reuse) is mirrored where the draft rows hold the same prefix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.spec_decode import rejection
from engine.spec_decode.proposer import DRAFT_MODEL, Draft, DraftRow
from engine.speculative import CheckCost

if TYPE_CHECKING:
    from engine.constraint_masks import ConstraintMasks

log = logging.getLogger(__name__)

# A catch-up chunk of at most this many tokens is the steady cost of a draft's first token (after a check: the last
# draft token and the target's own); a longer one (a row resuming after plain steps, a new prompt) is priced per token
# (``CheckCost.record_resume``: what a probe after plain steps costs besides).
CATCH_UP_TOKENS = 4


class DraftModelProposer:
    """Drafts of a draft model for the target's rows (core thread only).

    Usage::

        proposer = DraftModelProposer(draft_runner, target_vocab, p_min=0.75)
        drafts = proposer.propose([DraftRow(request, 4), ...])  # one Draft per row, tokens and q per token

    Args:
        runner: the draft model's runner (row views: ``engine.runner.Runner``), as many slots as the target's.
        cost: the scheduler's ``CheckCost``, told each proposal's time per draft token (None: not told).
        vocab_size: the target's logits width (q rows are this wide; a narrower draft's are padded with zeros).
        p_min: a row stops drafting once the draft gave its token less than this probability (llama.cpp's
            --draft-p-min): the next token is then likelier to be rejected than to pay.
        min_tokens: a draft shorter than this is dropped (llama.cpp's --draft-min); the row decodes one token.
    """

    name = DRAFT_MODEL

    def __init__(self, runner: Any, vocab_size: int, p_min: float = 0.0, min_tokens: int = 0,
                 cost: CheckCost | None = None) -> None:
        self.runner = runner
        self.cost = cost  # where each proposal's time per draft token is recorded (the scheduler's)
        self.vocab_size = vocab_size
        self.draft_vocab = min(runner.vocab_size, vocab_size)
        self.p_min = p_min
        self.min_tokens = min_tokens
        self._held: list[list[int]] = [[] for _ in range(runner.num_slots)]
        self.num_runs = 0  # the draft model's runs (chunks and batched steps)
        self.last_s = 0.0  # seconds of the last propose

    def copy_kv(self, src: int, dst: int, start: int, end: int) -> None:
        """Mirror a target KV copy of positions ``[start, end)`` from slot ``src`` to ``dst`` where the draft rows hold
        the same first ``start`` tokens and ``src`` holds ``end`` (else the draft row of ``dst`` is left as it is)."""
        held_src, held_dst = self._held[src], self._held[dst]
        if len(held_src) >= end and len(held_dst) >= start and held_dst[:start] == held_src[:start]:
            self.runner.copy_kv(src, dst, start, end)
            self._held[dst] = held_src[:end]

    def propose(self, rows: Sequence[DraftRow], masks: ConstraintMasks | None = None) -> list[Draft]:
        """One Draft per row (at most ``row.num_tokens`` tokens), in row order; ``masks``: a constrained request
        drafts only tokens its grammar allows (``ConstraintMasks.mask_draft_logits``; its grammar is advanced through
        its draft as it grows, and left as it was on return)."""
        states = [_RowDraft(row) for row in rows]
        if masks is not None:
            for state in states:
                constraint = state.row.request.constraint
                if constraint is not None:
                    state.constraint, state.saved = constraint, constraint.checkpoint()
        try:
            return self._propose(states, masks)
        finally:
            for state in states:
                if state.constraint is not None:
                    state.constraint.restore(state.saved)

    def _propose(self, states: list[_RowDraft], masks: ConstraintMasks | None) -> list[Draft]:
        clock = time.perf_counter
        t0 = clock()
        first_s, first_rows, later_s, later_tokens = 0.0, 0, 0.0, 0
        # 1. Catch each row up: the tokens after the prefix its draft row holds, and its last token, as one chunk
        #    (its last logits give the first draft token); a row with only the last token to feed joins step 2 at once.
        for state in states:
            request = state.row.request
            tokens = [*request.prompt_ids, *request.output_ids]
            slot = request.slot
            held = self._held[slot]
            common = _common_prefix(held, tokens, len(tokens) - 1)
            del held[common:]
            self.runner.release(slot, keep=common)  # positions past it are free (idle rows write there)
            pending = tokens[common:]
            if len(pending) > 1:
                t1 = clock()
                logits = self._chunk(slot, pending, common)
                held.extend(pending)
                self._take(state, logits, masks)  # (timed too: on a GPU its host work is a good part of a draft token)
                seconds = clock() - t1
                if len(pending) <= CATCH_UP_TOKENS:  # NOTE(engine): each draft's own; longer ones are priced apart
                    first_s, first_rows = first_s + seconds, first_rows + 1
                elif self.cost is not None:
                    self.cost.record_resume(seconds, len(pending))
            else:
                state.feed = pending[0]
        # 2. Decode runs of every row still drafting, together (slots ascending).
        while True:
            live = sorted((s for s in states if s.feed is not None), key=lambda s: s.row.request.slot)
            if not live:
                break
            slots = [s.row.request.slot for s in live]
            positions = [len(self._held[slot]) for slot in slots]
            firsts = [not s.token_ids for s in live]  # a row's first token (it had only its last token to feed)
            t1 = clock()
            logits = self.runner.decode(slots, [s.feed for s in live], positions)  # [n, V]
            self.num_runs += 1
            for state, slot, row_logits in zip(live, slots, logits):
                self._held[slot].append(state.feed)
                self._take(state, row_logits, masks)
            share = (clock() - t1) / len(live)  # the run and each row's choice of its token
            num_first = sum(firsts)
            first_s, first_rows = first_s + share * num_first, first_rows + num_first
            later_s, later_tokens = later_s + share * (len(live) - num_first), later_tokens + len(live) - num_first
        self.last_s = clock() - t0
        drafts = [s.result(self.vocab_size, self.min_tokens) for s in states]
        if self.cost is not None:
            self.cost.record_draft(first_s, first_rows, later_s, later_tokens)
        return drafts

    def _chunk(self, slot: int, tokens: list[int], start: int) -> np.ndarray:
        """Run ``tokens`` at ``start`` in the draft row of ``slot`` (pieces of at most a prefill chunk); the logits of
        the last one, float32 ``[V]``."""
        limit = self.runner.prefill_chunk
        logits = None
        for at in range(0, len(tokens), limit):
            logits = self.runner.prefill(slot, tokens[at:at + limit], start + at)
            self.num_runs += 1
        return logits

    def _take(self, state: _RowDraft, logits: np.ndarray, masks: ConstraintMasks | None) -> None:
        """The next draft token of ``state`` from the draft's logits after its last token; sets what it feeds next
        (None: its draft is complete)."""
        request = state.row.request
        sampler = request.sampler_state
        row = logits[:self.draft_vocab]
        if self.draft_vocab < self.vocab_size:  # the target's width, for the request's law (penalties, bias)
            row = np.concatenate([row, np.full(self.vocab_size - self.draft_vocab, -np.inf, dtype=row.dtype)])
        if state.constraint is not None:  # NOTE(engine): first, as in decoding: no transform brings a token back
            row = masks.mask_draft_logits(request, row)
            if not np.isfinite(row).any():  # nothing allowed (a key rule that empties the row): the draft ends
                state.feed = None
                return
        if sampler.greedy:
            token = int(np.argmax(row))
            shifted = row - row[token]
            prob = float(1.0 / np.exp(shifted, dtype=np.float64).sum())  # the draft's probability of its argmax
            q = None
        else:  # NOTE(engine): drawn from q = the request's own law on the draft's logits; q goes to the check
            q = rejection.probabilities(sampler.process(row))
            token = rejection.draw(q, sampler.rng.random())
            prob = float(q[token])
        if state.constraint is not None and not state.constraint.accept(token):  # (an empty mask: nothing allowed)
            state.feed = None
            return
        state.token_ids.append(token)
        if q is not None:
            state.probs.append(q)
        done = len(state.token_ids) >= state.row.num_tokens or (
            prob < self.p_min and len(state.token_ids) >= max(1, self.min_tokens)) or (
            state.constraint is not None and state.constraint.is_done)  # complete: nothing may follow
        state.feed = None if done else token


class _RowDraft:
    """One row's draft as it grows."""

    __slots__ = ("row", "token_ids", "probs", "feed", "constraint", "saved")

    def __init__(self, row: DraftRow) -> None:
        self.row = row
        self.token_ids: list[int] = []
        self.probs: list[np.ndarray] = []
        self.feed: int | None = None  # the token the next decode run feeds (None: not in the run)
        self.constraint: Any = None  # the request's grammar, advanced through the draft (None: unconstrained)
        self.saved: Any = None  # where it stood before the draft (restored after the proposal)

    def result(self, vocab_size: int, min_tokens: int) -> Draft:
        request = self.row.request
        if len(self.token_ids) < min_tokens:
            return Draft(request, (), source=DRAFT_MODEL)
        probs = None
        if self.probs:
            q = np.stack(self.probs)  # [k, V] (the target's width: tokens the draft cannot name have no mass)
            probs = q
        return Draft(request, tuple(self.token_ids), probs, DRAFT_MODEL)


def _common_prefix(held: list[int], tokens: list[int], limit: int) -> int:
    """How many leading tokens ``held`` and ``tokens`` share, at most ``limit``."""
    n = min(len(held), limit)
    if held[:n] == tokens[:n]:
        return n
    i = 0
    while i < n and held[i] == tokens[i]:
        i += 1
    return i
