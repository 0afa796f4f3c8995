"""EngineCore's draft checks (a part of ``engine.core.EngineCore``, kept apart to keep that class short): the draft
model's proposals for a step's draft rows, and the run that checks one request's draft.

Core thread only; the attributes used are EngineCore's (runner, scheduler, masks, stats, fault_injector, draft_model)
and so are ``_fail``, ``_emit`` and ``_check_finite``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
import numpy as np

from engine.sampling_law import apply_token_bitmask
from engine.scheduler import Request, SchedulerOutput, Verify
from engine.types import FaultInjector, StepInfo


def inject(fault_injector: FaultInjector | None, step: int, kind: str, requests: Sequence[Request]) -> None:
    """Call the test-only fault injector (if any) before a run of ``kind`` over ``requests`` in step ``step``."""
    if fault_injector is not None:
        fault_injector(StepInfo(step, kind, tuple(r.request_id for r in requests)))


class DraftChecks:
    """Mixed into EngineCore: ``_propose`` and ``_run_verify``."""

    def _propose(self, out: SchedulerOutput) -> list[Verify]:
        """The draft model's drafts for ``out.draft_rows`` (batched runs), as checks; a failed run fails its rows."""
        rows = out.draft_rows
        try:
            inject(self.fault_injector, self.stats.steps_total, "draft", [r.request for r in rows])
            drafts = self.draft_model.propose(rows, self.masks if self.masks.structured is not None else None)
            return [Verify(d.request, d.token_ids, d.probs, d.source) for d in drafts]
        except Exception as exc:
            self._fail([r.request for r in rows], exc)
            return []

    def _run_verify(self, verify: Verify) -> int:
        """Check one request's draft in one run; returns the tokens it added. A constrained request's draft is cut
        where its grammar forbids a token, and each row of the check is masked (``ConstraintMasks.check_rows``)."""
        request = verify.request
        failed: dict[Request, str] = {}
        try:
            rows = None
            if request.constraint is not None:
                draft, rows = self.masks.check_rows(request, verify.draft)
                if len(draft) < len(verify.draft):
                    probs = verify.draft_probs[:len(draft)] if verify.draft_probs is not None else None
                    verify = replace(verify, draft=draft, draft_probs=probs)
            inject(self.fault_injector, self.stats.steps_total, "verify", (request,))
            logits = self.runner.verify(request.slot, verify.token_ids, request.num_computed_tokens)  # [S, V]
            if rows is not None:  # NOTE(engine): row j as plain decoding masks it after draft[:j] (a new array)
                logits = apply_token_bitmask(logits[:len(verify.draft) + 1], rows)
            results = request.sampler_state.verify(logits, verify.draft, verify.draft_probs)
        except Exception as exc:
            self._fail((request,), exc)
            return 0
        self._check_finite([request] * len(results), logits[np.arange(len(results)), [r.token_id for r in results]])
        check = (len(verify.draft), len(results) - 1) if verify.draft else None  # (drafted, accepted)
        complete: set[Request] = set()
        if request.constraint is not None:
            num_kept, done = self.masks.advance_check(request, results, failed)
            results = results[:num_kept]
            if done:
                complete.add(request)
        num_before = len(request.output_ids)
        finished = self.scheduler.update_from_output(SchedulerOutput(None, (), (verify,)),
                                                     {request: [r.token_id for r in results]}, complete)
        num_added = len(request.output_ids) - num_before  # fewer than results when a stop token came first
        self.stats.generation_tokens_total += num_added
        if check is not None:
            self.stats.record_draft(*check)
        self._emit([(request, results[:num_added])], finished, failed, complete, spec_check=check)
        return num_added
