"""ConstraintMasks: the core's side of constrained decoding in a step: fill the token bitmask rows of a batch's
constrained requests before sampling, advance their grammars by the sampled tokens after; with speculative decoding,
the masks of a draft's positions (a draft model drafts inside the grammar, a check is masked row by row) and the
grammar's advance by a check's tokens. No onnxruntime import.

NOTE(engine): drafts inside a grammar, as vLLM's structured output does under speculation: a draft is cut at its first
token the grammar (or the repeated-key rule) forbids; each row of its check is masked by the grammar as it stands
after the draft tokens before it (the grammar advanced through them, then rolled back: ``GrammarConstraint.checkpoint``
/ ``restore``); the tokens the check yields then advance it for real. The masked rows are what plain decoding would
have masked, so the output is the drafts-off output (greedy) or follows the same law (sampled).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine.sampler import SampleResult
from engine.sampling_law import apply_token_bitmask, token_allowed
from engine.scheduler import Request

if TYPE_CHECKING:
    from engine.structured_output import StructuredOutputBackend

log = logging.getLogger(__name__)


class ConstraintMasks:
    """The token bitmask of a core's batches and the grammar backend that fills it.

    Args:
        structured: fills the masks of requests with a ``constraint`` (None: no request is constrained).
        num_rows: the most requests a batch holds (the scheduler's slots).
    """

    def __init__(self, structured: StructuredOutputBackend | None, num_rows: int) -> None:
        self.structured = structured
        # NOTE(engine): one preallocated bitmask, one row per batch position; only constrained rows are
        # filled and read, so a batch without constraints never touches it.
        self.bitmask: np.ndarray | None = structured.allocate_bitmask(num_rows) if structured is not None else None
        self._draft_bitmask: np.ndarray | None = None  # the rows of one draft's positions (grown on demand)

    def fill(self, batch: Sequence[Request], failed: dict[Request, str]) -> list[int]:
        """Fill the bitmask rows of the constrained requests of ``batch`` (row i for batch[i]).

        Returns the rows to mask; a constraint already in error (a grammar resource limit) goes to
        ``failed`` instead, and its row is sampled unmasked and then dropped.
        """
        rows = [(r.constraint, i) for i, r in enumerate(batch) if r.constraint is not None]
        if not rows:
            return []
        assert self.structured is not None and self.bitmask is not None
        self.structured.fill(rows, self.bitmask)
        masked = []
        for constraint, i in rows:
            error = constraint.error
            if error is None:
                masked.append(i)
            else:
                failed[batch[i]] = f"structured output failed: {error}"
        return masked

    @staticmethod
    def advance(batch: Sequence[Request], results: Sequence[SampleResult], masked: Sequence[int],
                failed: dict[Request, str]) -> set[Request]:
        """After sampling: advance each constraint by its token; returns the requests now complete.

        A token the grammar rejects fails that choice only (into ``failed``). A stop token (eos) that
        completes the grammar is left to the usual stop check.
        """
        complete = set()
        for i in masked:
            request, token_id = batch[i], results[i].token_id
            try:
                accepted = request.constraint.accept(token_id)
                done = accepted and request.constraint.is_done
            except Exception as exc:  # NOTE(engine): the library raises only on API misuse; still, one request
                log.exception("constraint of %s raised", request.request_id)
                failed[request] = f"structured output failed: {type(exc).__name__}: {exc}"
                continue
            if not accepted:
                failed[request] = (f"structured output failed: the grammar rejected token {token_id} "
                                   f"({request.constraint.error})")
            elif done and not request.is_stop_token(token_id):
                complete.add(request)
        return complete

    # -- speculative decoding ---------------------------------------------------------------------------------------

    def _draft_rows(self, num_rows: int) -> np.ndarray:
        assert self.structured is not None
        if self._draft_bitmask is None or len(self._draft_bitmask) < num_rows:
            self._draft_bitmask = self.structured.allocate_bitmask(max(num_rows, 17))
        return self._draft_bitmask

    def mask_draft_logits(self, request: Request, logits: np.ndarray) -> np.ndarray:
        """``logits`` (float ``[vocab]``, a draft model's) with what ``request``'s grammar forbids now at ``-inf``: the
        draft model drafts only tokens the grammar allows. A new array."""
        rows = self._draft_rows(1)
        request.constraint.fill(rows, 0)
        return apply_token_bitmask(logits, rows[0])

    def check_rows(self, request: Request, draft: tuple[int, ...]) -> tuple[tuple[int, ...], np.ndarray]:
        """The part of ``draft`` a check of ``request`` runs (cut at the first token its grammar forbids, and after
        one that completes the grammar) and the masks of the check's rows, int32 ``[len(cut) + 1, words]``: row j
        allows what may follow the request's tokens and ``cut[:j]``. The grammar is left as it was. The rows are
        valid until the next call."""
        constraint = request.constraint
        rows = self._draft_rows(len(draft) + 1)
        saved = constraint.checkpoint()
        kept = 0
        try:
            constraint.fill(rows, 0)
            while kept < len(draft) and not constraint.is_done:
                token_id = draft[kept]
                if not token_allowed(rows[kept], token_id) or not constraint.accept(token_id):
                    break
                kept += 1
                if constraint.is_done:  # NOTE(engine): complete: the token after it is never kept (advance_check)
                    rows[kept] = -1
                else:
                    constraint.fill(rows, kept)
        finally:
            constraint.restore(saved)
        return draft[:kept], rows[:kept + 1]

    @staticmethod
    def advance_check(request: Request, results: Sequence[SampleResult],
                      failed: dict[Request, str]) -> tuple[int, bool]:
        """After a check of ``request``: advance its grammar by the check's tokens in order. Returns (how many of
        them stand, whether the grammar completed): a stop token, or a token that completes the grammar, ends the list
        (nothing may follow it), and a token the grammar rejects fails the choice (into ``failed``; as ``advance``)."""
        constraint = request.constraint
        for i, result in enumerate(results):
            token_id = result.token_id
            try:
                accepted = constraint.accept(token_id)
            except Exception as exc:  # NOTE(engine): as in advance: one request's problem, not the core's
                log.exception("constraint of %s raised", request.request_id)
                failed[request] = f"structured output failed: {type(exc).__name__}: {exc}"
                return i + 1, False
            if not accepted:
                failed[request] = (f"structured output failed: the grammar rejected token {token_id} "
                                   f"({constraint.error})")
                return i + 1, False
            if request.is_stop_token(token_id):  # the usual stop check ends the request here
                return i + 1, False
            if constraint.is_done:
                return i + 1, True
        return len(results), False
