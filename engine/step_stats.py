"""The engine core's running counters: tokens, steps, the decode rate, drafts, and where each step's time went
(``PhaseTimes``); ``StepStats.snapshot`` publishes them as a ``CoreSnapshot``. Pure Python, no onnxruntime import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine.scheduler import Scheduler
from engine.types import CoreSnapshot


@dataclass(slots=True)
class PhaseTimes:
    """Wall seconds the core thread spent in each phase of its steps, summed over all steps."""

    schedule: float = 0.0  # schedule (and KV copies)
    decode_run: float = 0.0  # masks + the decode run, logits on the host
    decode_sample: float = 0.0
    decode_update: float = 0.0  # constraints, scheduler update, outputs handed over
    verify: float = 0.0  # draft checks
    prefill: float = 0.0  # prompt chunks and their first tokens (and prompts run together)

    def as_tuple(self) -> tuple[float, ...]:
        """The seconds in ``PHASES`` order."""
        return (self.schedule, self.decode_run, self.decode_sample, self.decode_update, self.verify, self.prefill)


# The phase names, in the order of ``CoreSnapshot.phase_s`` (metrics and the step trace label them so).
PHASES = tuple(f.name for f in fields(PhaseTimes))
assert PHASES == ("schedule", "decode_run", "decode_sample", "decode_update", "verify", "prefill")  # as_tuple's order


@dataclass(slots=True)
class StepStats:
    """What the core counts as it steps; only the core thread writes it."""

    phase: PhaseTimes = field(default_factory=PhaseTimes)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    steps_total: int = 0
    # batch runs (rows of priority > 0 only) an interactive request's arrival stopped midway, or kept from starting
    runs_stopped_total: int = 0
    runs_skipped_total: int = 0
    decode_tokens_per_s: float = 0.0  # recent decode tokens/s, all streams together (see record_step)
    spec_draft_tokens_total: int = 0  # tokens proposed by speculative drafts
    spec_accepted_tokens_total: int = 0  # of them, tokens the model kept
    spec_drafts_total: int = 0  # draft checks (vLLM's spec_decode_num_drafts)
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # [i]: checks whose draft token i was kept

    def record_draft(self, num_draft: int, num_accepted: int) -> None:
        """Count one check of ``num_draft`` draft tokens of which the first ``num_accepted`` were kept."""
        if num_draft <= 0:
            return
        self.spec_drafts_total += 1
        self.spec_draft_tokens_total += num_draft
        self.spec_accepted_tokens_total += num_accepted
        per_pos = self.spec_accepted_per_pos
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def record_interrupt(self, started: bool) -> None:
        """Count one batch run an interactive request's arrival stopped (``started``) or kept from starting."""
        if started:
            self.runs_stopped_total += 1
        else:
            self.runs_skipped_total += 1

    def record_step(self, num_decoded: int, elapsed_s: float) -> None:
        """Count one step that produced ``num_decoded`` decode tokens in ``elapsed_s`` wall seconds."""
        self.steps_total += 1
        if num_decoded and elapsed_s > 0:
            # NOTE(engine): an exponential average of decode tokens/s over recent steps, for metrics.
            rate = num_decoded / elapsed_s
            self.decode_tokens_per_s = 0.8 * self.decode_tokens_per_s + 0.2 * rate if self.decode_tokens_per_s \
                else rate

    def snapshot(self, scheduler: Scheduler, now: float, thread_cpu_s: float) -> CoreSnapshot:
        """These counters and the scheduler's state as one immutable record (``now``: time.monotonic seconds)."""
        s = scheduler
        return CoreSnapshot(
            num_running=len(s.running), num_waiting=len(s.waiting), num_slots_free=s.num_free_slots,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            decode_tokens_per_s=self.decode_tokens_per_s if s.running else 0.0, steps_total=self.steps_total,
            last_step_s=now, prefix_cache_queries_total=s.prefix_queries_total,
            prefix_cache_hits_total=s.prefix_hits_total, spec_draft_tokens_total=self.spec_draft_tokens_total,
            spec_accepted_tokens_total=self.spec_accepted_tokens_total, spec_drafts_total=self.spec_drafts_total,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
            num_kv_tokens_running=sum(r.num_computed_tokens for r in s.running.values()),
            num_kv_tokens_cached=s.cache.num_tokens, runs_stopped_total=self.runs_stopped_total,
            runs_skipped_total=self.runs_skipped_total, phase_s=self.phase.as_tuple(), thread_cpu_s=thread_cpu_s)
