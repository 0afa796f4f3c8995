"""EngineCore: the one thread that owns the session, KV cache, scheduler and samplers.

inbox (adds, aborts) -> schedule -> run -> sample -> update -> outputs to a sink. Talks to the
async side only through its inbox queue and the sink callback; no locks around session.run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine.constraint_masks import ConstraintMasks
from engine.core_checks import DraftChecks, inject
from engine.core_inbox import SHUTDOWN, CoreInbox
from engine.core_wire import AbortRequests
from engine.model_runner import ModelRunner
from engine.run_interrupt import RunInterrupt, RunInterrupted
from engine.sampler import RequestSampler, SampleResult, needs_logits, sample_batch
from engine.scheduler import Finished, PrefillChunk, Request, Scheduler, SchedulerOutput
from engine.step_stats import PHASES, StepStats
from engine.step_trace import StepTrace
from engine.types import (
    CoreOutput, CoreSnapshot, EngineDeadError, EngineError, FaultInjector, FinishReason, Sink,
)

if TYPE_CHECKING:
    from engine.spec_decode.draft_model import DraftModelProposer
    from engine.structured_output import StructuredOutputBackend

log = logging.getLogger(__name__)




class EngineCore(DraftChecks):
    """The engine thread.

    Args:
        runner: runs the model.
        scheduler: decides each step.
        sink: receives each step's outputs, called on the core thread (must only hand them over).
        seed: seeds the rng that unseeded requests draw from (None: fresh entropy).
        fault_injector: test-only; called with a StepInfo before every model run (None: no call at all).
        structured: fills the token masks of requests with a ``constraint`` (constrained decoding).
        between_steps: called before each inbox drain with ``idle`` (the core is about to wait for work).
        step_trace: a file each step is recorded in (``engine.step_trace``); None: no record.
        draft_model: the draft model's proposer (speculative decoding with a draft model); None: none.
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sink: Sink, seed: int | None = None,
                 fault_injector: FaultInjector | None = None,
                 structured: StructuredOutputBackend | None = None,
                 between_steps: Callable[[bool], None] | None = None, step_trace: str | None = None,
                 draft_model: DraftModelProposer | None = None) -> None:
        self.runner = runner
        self.draft_model = draft_model
        self._kv_rows = (runner,) if draft_model is None else (runner, draft_model)  # what a KV copy applies to
        # NOTE(engine): called on the core thread before each inbox drain, with True when the core is about to
        # wait for work (an engine process sends its snapshot then: engine.core_process).
        self.between_steps = between_steps
        self.fault_injector = fault_injector
        self.masks = ConstraintMasks(structured, scheduler.num_slots)
        self.scheduler = scheduler
        self.sink = sink
        self.vocab_size = runner.vocab_size
        self._seeds = np.random.SeedSequence(seed)
        self._inbox = CoreInbox()
        # NOTE(engine): runs of batch rows only stop when an interactive request arrives (engine.run_interrupt); a
        # runner without a RunOptions to stop still keeps the next batch run from starting.
        self._interrupt: RunInterrupt = getattr(runner, "interrupt", None) or RunInterrupt(None)
        self._thread: threading.Thread | None = None
        self.snapshot = CoreSnapshot(num_slots_free=scheduler.num_slots)
        self.dead: BaseException | None = None
        self.stats = StepStats()
        self._nonfinite_reported = False
        self._trace = StepTrace(step_trace, PHASES) if step_trace else None
        if self._trace is not None:
            runner.run_log = []

    # -- called from other threads ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ortserve-engine-core", daemon=True)
        self._thread.start()

    def add(self, request: Request) -> None:
        """Queue a request for the core thread; raises EngineDeadError once the loop has ended."""
        if not self._inbox.add(request):
            raise EngineDeadError(f"the engine thread has stopped: {self.dead!r}")
        self._interrupt.arrived(request.priority)  # after the add: the core finds it once it stops

    def abort(self, request_ids: Sequence[str], index: int | None = None) -> None:
        """Stop requests (every choice, or only choice ``index`` of an n > 1 request)."""
        self._inbox.abort(request_ids, index)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort everything, stop the thread and wait for it."""
        self._inbox.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the core thread to end (after ``shutdown``, or once it died)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    # -- the thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain(block=not self.scheduler.has_work):
                if self.scheduler.has_work:
                    self.step()
        except BaseException as exc:  # a bug in the loop itself: everything in flight fails
            log.exception("engine core died")
            self.dead = exc
            self._finish_all(FinishReason.ERROR, f"engine failed: {exc!r}",
                             EngineDeadError(f"the engine thread has stopped: {exc!r}"))
            return
        finally:
            if self._trace is not None:
                self._trace.close()
        self._finish_all(FinishReason.ABORT, None)

    def _drain(self, block: bool) -> bool:
        """Apply everything in the inbox; False once shutdown was asked for."""
        if self.between_steps is not None:
            self.between_steps(block)
        self._interrupt.drained()
        changed = False
        while True:
            # NOTE(engine): empty() rather than get(block=False) and queue.Empty: an empty inbox is the usual
            # case between steps, and this thread is its only reader, so a non-empty one cannot empty meanwhile.
            if not block and self._inbox.empty():
                if changed:
                    self._publish(time.monotonic())
                return True
            item = self._inbox.get(block=block)
            block, changed = False, True
            if item is SHUTDOWN:
                return False
            if isinstance(item, AbortRequests):
                for request in self.scheduler.abort(item.request_ids, item.index):
                    self._release(request)
            elif isinstance(item, Request):
                self._add(item)

    def _add(self, request: Request) -> None:
        """Queue one request; a problem with it (overload, bad params) fails only that request."""
        try:
            for choice in (request, *request.forks):
                choice.sampler_state = RequestSampler(choice.params, choice.prompt_ids, self.vocab_size,
                                                      choice_rng(self._seeds, choice))
            self.scheduler.add(request)
        except Exception as exc:  # NOTE(engine): never let one request's problem stop the core thread
            refused = isinstance(exc, EngineError)  # overloaded, invalid: raised to the caller as is
            if not refused:
                log.exception("could not queue request %s", request.request_id)
            self.sink([CoreOutput(request.request_id, (), FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}",
                                  seq=request.seq, exception=exc if refused else None)])

    def step(self) -> None:
        """One scheduler step: KV copies, the decode batch (outputs sent at once), draft checks, then the
        prefill chunks (one run each)."""
        stats, phase, clock = self.stats, self.stats.phase, time.perf_counter
        t0 = clock()
        before = phase.as_tuple() if self._trace is not None else ()
        out = self.scheduler.schedule()
        for slot, keep in out.released:  # rows of preempted requests, before anything reads or writes them
            self.runner.release(slot, keep)
        for copy in out.copies:  # NOTE(engine): before any run: a copy reads rows this step may overwrite
            for rows in self._kv_rows:  # the target's rows, and the draft model's where there is one
                rows.copy_kv(copy.src, copy.dst, copy.start, copy.end)
        t = clock()
        phase.schedule += t - t0
        prefills: Sequence[PrefillChunk] = out.prefills
        joined: tuple[PrefillChunk, ...] = ()
        num_decoded = num_verified = 0
        try:
            if prefills and self.runner.can_batch_prompts:
                joined, prefills = self._run_prompts(prefills)
                phase.prefill += clock() - t
            if out.decode or joined:
                t = clock()
                self._run_decode(out.decode, joined)
                num_decoded = len(out.decode)
                if (not (joined or out.verify or out.draft_rows or prefills)
                        and num_decoded <= self.scheduler.speculative_max_batch):
                    self.scheduler.check_cost.record_decode(clock() - t)  # the step a draft check would replace
            if out.verify or out.draft_rows:
                t = clock()
                for verify in (*out.verify, *(self._propose(out) if out.draft_rows else ())):
                    t1 = clock()
                    num_verified += self._run_verify(verify)
                    self.scheduler.check_cost.record_check(len(verify.draft), clock() - t1)
                phase.verify += clock() - t
            if prefills:
                t = clock()
                for chunk in prefills:  # NOTE(engine): each its own run; a last chunk's first token goes out at once
                    self._run_prefill(chunk)
                phase.prefill += clock() - t
        except RunInterrupted as stop:  # NOTE(engine): nothing of the stopped run counts; its rows run again
            stats.record_interrupt(stop.started)
        end = clock()
        if self._trace is not None:
            self._trace.step(t0, end, before, phase.as_tuple(), decode=len(out.decode) + len(joined),
                             prefill=[c.num_tokens for c in prefills], prefill_start=[c.start for c in prefills],
                             joined=len(joined), copies=len(out.copies),
                             verify=len(out.verify) + len(out.draft_rows), runs=self.runner.run_log)
            self.runner.run_log = []
        stats.record_step(num_decoded + num_verified, end - t0)
        self._publish(time.monotonic())

    def _run_prompts(self, chunks: Sequence[PrefillChunk]) -> tuple[tuple[PrefillChunk, ...], list[PrefillChunk]]:
        """Run the whole prompts among ``chunks`` together but for their last tokens (``runner.prefill_prompts``);
        returns (those chunks, whose last tokens join this step's decode run, the chunks left to run alone).

        NOTE(engine): a prompt of one chunk (no reused prefix, no n > 1 choices) on a runner that batches prompts.
        Its last token decodes with the running streams, so a burst of new requests costs one prompt run and no
        run of its own per request (on CUDA each run is ~200 kernel launches whatever its size).
        """
        limit = self.runner.max_batched_prompt
        batch = sorted((c for c in chunks if c.start == 0 and c.is_last and not c.request.forks
                        and 2 <= c.num_tokens <= limit + 1), key=lambda c: c.request.slot)
        if not batch:
            return (), list(chunks)
        rest = [c for c in chunks if all(c is not b for b in batch)]
        try:
            inject(self.fault_injector, self.stats.steps_total, "prefill", [c.request for c in batch])
            with self._interrupt.batch_run(all(c.request.priority for c in batch)):
                self.runner.prefill_prompts([c.request.slot for c in batch], [c.token_ids[:-1] for c in batch])
        except RunInterrupted:
            raise
        except Exception as exc:
            self._fail([c.request for c in batch], exc)
            return (), rest
        self.stats.prompt_tokens_total += sum(c.num_tokens - 1 for c in batch)
        return tuple(batch), rest

    def _run_decode(self, running: tuple[Request, ...], joined: tuple[PrefillChunk, ...] = ()) -> None:
        """One decode run: a token for each of ``running`` and the last prompt token of each ``joined`` chunk
        (``_run_prompts``), whose sample is the request's first token."""
        failed: dict[Request, str] = {}  # why a choice's constraint failed (that choice only)
        phase, clock = self.stats.phase, time.perf_counter
        t0 = clock()
        batch = running
        positions = {id(c.request): len(c.request.prompt_ids) - 1 for c in joined}
        if joined:
            batch = tuple(sorted((*running, *(c.request for c in joined)), key=lambda r: r.slot))
        try:
            masked = self.masks.fill(batch, failed)
            inject(self.fault_injector, self.stats.steps_total, "decode", batch)
            samplers = [r.sampler_state for r in batch]
            with self._interrupt.batch_run(all(r.priority for r in batch)):
                logits = self.runner.decode([r.slot for r in batch], [r.last_token_id for r in batch],
                                            [positions.get(id(r), r.num_computed_tokens) for r in batch],
                                            logits=needs_logits(samplers, masked))
            t1 = clock()
            summary = self.runner.decode_summary
            results = sample_batch(logits, samplers, self.masks.bitmask, masked, summary=summary)
        except RunInterrupted:
            raise
        except Exception as exc:
            self._fail(batch, exc)
            return
        self._check_finite(batch, summary[1] if logits is None and summary is not None else
                           logits[np.arange(len(batch)), [r.token_id for r in results]])
        t2 = clock()
        sampled = {r: res.token_id for r, res in zip(batch, results)}
        complete = self.masks.advance(batch, results, masked, failed)
        step = SchedulerOutput(joined[0] if joined else None, running, more_prefills=joined[1:])
        finished = self.scheduler.update_from_output(step, sampled, complete)
        self.stats.generation_tokens_total += len(batch)
        self.stats.prompt_tokens_total += len(joined)
        self._emit([(r, (res,)) for r, res in zip(batch, results)], finished, failed, complete)
        phase.decode_run += t1 - t0
        phase.decode_sample += t2 - t1
        phase.decode_update += clock() - t2

    def _run_prefill(self, chunk: PrefillChunk) -> None:
        request = chunk.request
        choices = (request, *request.forks)
        failed: dict[Request, str] = {}
        try:
            # NOTE(engine): only the last chunk of a prompt samples, so only it is masked.
            masked = self.masks.fill(choices, failed) if chunk.is_last else []
            inject(self.fault_injector, self.stats.steps_total, "prefill", (request,))
            with self._interrupt.batch_run(request.priority > 0):
                logits = self.runner.prefill(request.slot, chunk.token_ids, chunk.start,
                                             also=[f.slot for f in request.forks])
            # n > 1: every choice samples its first token from the same logits, each with its own sampler
            results = sample_batch(np.broadcast_to(logits, (len(choices), len(logits))),
                                   [c.sampler_state for c in choices], self.masks.bitmask, masked) \
                if chunk.is_last else []
        except RunInterrupted:
            raise
        except Exception as exc:
            self._fail(choices, exc)
            return
        if results:
            self._check_finite(choices, logits[[r.token_id for r in results]])
        sampled = {c: res.token_id for c, res in zip(choices, results)}
        complete = self.masks.advance(choices, results, masked, failed) if results else set()
        finished = self.scheduler.update_from_output(SchedulerOutput(chunk, ()), sampled, complete)
        self.stats.prompt_tokens_total += chunk.num_tokens
        if results:
            self.stats.generation_tokens_total += len(results)
            self._emit([(c, (res,)) for c, res in zip(choices, results)], finished, failed, complete)

    def _check_finite(self, batch: Sequence[Request], values: np.ndarray) -> None:
        """``values[i]``: a number of ``batch[i]``'s logits (the chosen token's logit, or its row's log-normalizer),
        O(rows). A request whose logits are not finite (NaN or inf: a model that overflows float16) drafts no more:
        its tokens are arbitrary, and the device's argmax and the host's need not agree over NaN, so a check would
        only cost. Reported once per engine in the log."""
        if not np.isfinite(values).all():
            self._nonfinite_reported = stop_nonfinite(self.scheduler, batch, values, self._nonfinite_reported)

    def _emit(self, items: Sequence[tuple[Request, Sequence[SampleResult]]], finished: list[Finished],
              failed: dict[Request, str] | None = None, complete: set[Request] | None = None,
              spec_check: tuple[int, int] | None = None) -> None:
        """Send one output per request of ``items`` (request, the results appended to it this step); a choice
        in ``failed`` ends with ERROR instead (its constraint failed); ``spec_check``: (drafted, accepted) of the
        draft check that made them (one item)."""
        reasons = {id(f.request): f.reason for f in finished}
        if failed:
            for r, error in failed.items():
                log.warning("request %s (choice %d) failed: %s", r.request_id, r.index, error)
                if id(r) not in reasons:
                    for dropped in self.scheduler.abort([r.request_id], r.index):
                        self._release(dropped)
        for f in finished:
            self._release(f.request)
        self._publish(time.monotonic())  # stats agree with the outputs by the time they are seen
        self.sink(step_outputs(items, reasons, failed, complete, spec_check))

    def _fail(self, batch: Sequence[Request], exc: Exception) -> None:
        """A run failed: its requests end with ERROR; the engine goes on with the others."""
        log.exception("engine step failed for %d request(s)", len(batch))
        for r in batch:
            for request in self.scheduler.abort([r.request_id], r.index):
                if request.slot is not None:
                    self.scheduler.forget(request.slot)  # NOTE(engine): no reuse of a row a failed run touched
                self._release(request)
        self.sink([CoreOutput(r.request_id, (), FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}",
                              seq=r.seq, index=r.index) for r in batch])

    def _finish_all(self, reason: FinishReason, error: str | None, exception: BaseException | None = None) -> None:
        dropped = self._inbox.close()  # adds that never reached the scheduler
        dropped = self.scheduler.abort_all() + dropped
        dropped += [fork for r in dropped if r.index == 0 and r.slot is None for fork in r.forks]  # never admitted
        for request in dropped:
            try:  # NOTE(engine): a broken runner must not keep the final outputs from their consumers
                self._release(request)
            except Exception:
                log.exception("could not release the slot of %s", request.request_id)
        if dropped:
            try:
                self.sink([CoreOutput(r.request_id, (), reason, error=error, seq=r.seq, exception=exception,
                                      index=r.index) for r in dropped])
            except Exception:  # the loop may be gone at shutdown
                log.debug("could not deliver final outputs", exc_info=True)
        self._publish(time.monotonic())

    def _release(self, request: Request) -> None:
        if request.slot is not None and self.scheduler.slot_owner(request.slot) is None:
            # NOTE(engine): the row keeps what the prefix cache says it holds (nothing once forgotten)
            self.runner.release(request.slot, keep=len(self.scheduler.cache.cached(request.slot)))

    def _publish(self, now: float) -> None:
        on_core_thread = threading.current_thread() is self._thread
        self.snapshot = self.stats.snapshot(self.scheduler, now, time.thread_time() if on_core_thread else
                                            self.snapshot.thread_cpu_s)


def stop_nonfinite(scheduler: Scheduler, batch: Sequence[Request], values: np.ndarray, reported: bool) -> bool:
    """``EngineCore._check_finite``'s work where some ``values`` are not finite: those rows' requests draft no more,
    and the first is logged unless ``reported``; returns whether one was reported by now."""
    for request, ok in zip(batch, np.isfinite(values).tolist()):
        if not ok:
            scheduler.stop_drafts(request)
            if not reported:
                reported = True
                log.warning("the model's logits are not finite (NaN or inf) in request %s after %d tokens: its "
                            "output is arbitrary (float16 overflow?); drafts are off for such requests "
                            "(reported once)", request.request_id, request.num_tokens)
    return reported


def step_outputs(items: Sequence[tuple[Request, Sequence[SampleResult]]], reasons: dict[int, FinishReason],
                 failed: dict[Request, str] | None, complete: set[Request] | None,
                 spec_check: tuple[int, int] | None = None) -> list[CoreOutput]:
    """One CoreOutput per request of ``items`` (request, the results appended to it this step): its tokens and
    log-probabilities, and ``reasons[id(request)]`` when it finished; a choice in ``failed`` ends with ERROR.
    ``spec_check`` (a draft check's (drafted, accepted)) goes on every output that is not an error."""
    outputs = []
    for r, results in items:
        if failed and r in failed:
            outputs.append(CoreOutput(r.request_id, (), FinishReason.ERROR, error=failed[r], seq=r.seq,
                                      first_scheduled_s=r.first_scheduled_s, index=r.index,
                                      num_cached_tokens=r.num_cached_tokens))
            continue
        logprobs = tuple(res.logprob for res in results if res.logprob is not None)
        outputs.append(CoreOutput(r.request_id, tuple(res.token_id for res in results), reasons.get(id(r)),
                                  logprobs or None, seq=r.seq, first_scheduled_s=r.first_scheduled_s,
                                  index=r.index, num_cached_tokens=r.num_cached_tokens,
                                  grammar_complete=bool(complete) and r in complete, spec_check=spec_check))
    return outputs


def choice_rng(seeds: np.random.SeedSequence, request: Request) -> np.random.Generator | None:
    """The rng of one choice: None for a seeded choice 0 (the sampler seeds it as with n = 1); choice i > 0
    of a seeded request draws from (seed, i), so seeded n > 1 requests are reproducible too; an unseeded one
    draws from a fresh child of ``seeds``."""
    seed = request.params.seed
    if seed is None:
        return np.random.default_rng(seeds.spawn(1)[0])
    return None if request.index == 0 else np.random.default_rng([seed, request.index])
