"""ConstraintMasks: the core's side of constrained decoding in a step: fill the token bitmask rows of a batch's
constrained requests before sampling, advance their grammars by the sampled tokens after. No onnxruntime import.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.sampler import SampleResult
from engine.scheduler import Request

if TYPE_CHECKING:
    import numpy as np

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
