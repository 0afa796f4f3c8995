"""Token-budget continuous batching over a fixed set of KV slots (rows of the shared KV buffer).

Pure Python: owns the waiting queue, slot assignment and stop checks; must not import onnxruntime or numpy.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.types import EngineOverloadedError, FinishReason, SamplingParams


@dataclass(eq=False)
class Request:
    """One request as the core thread tracks it (mutable; only the core thread touches it).

    NOTE(engine): ``num_computed_tokens`` counts tokens whose KV is in the slot's buffer. A request is
    in prefill while ``num_computed_tokens < len(prompt_ids)`` and in decode afterwards, when exactly one
    token (the last sampled) is not yet computed: ``num_computed_tokens == num_tokens - 1``.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 2048
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    slot: int | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    first_scheduled_s: float | None = None
    sampler_state: Any = None  # owned by the core (rng, penalty counts); opaque here
    constraint: Any = None  # the grammar of constrained decoding (engine.structured_output), owned by the core
    seq: int = 0  # unique per engine: tells a reused request_id's outputs apart

    def __post_init__(self) -> None:
        # Prompt + output never passes the context; max_tokens caps the output.
        self.max_num_tokens = min(len(self.prompt_ids) + self.params.max_tokens, self.max_model_len)
        self._stop_ids = frozenset(self.params.stop_token_ids) | (
            frozenset() if self.params.ignore_eos else self.eos_token_ids
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def is_stop_token(self, token_id: int) -> bool:
        """``token_id`` ends the request (eos unless ignore_eos, or one of stop_token_ids)."""
        return token_id in self._stop_ids

    def check_stop(self, token_id: int) -> FinishReason | None:
        """Why the request ends after appending ``token_id`` (already appended), or None."""
        if token_id in self._stop_ids:
            return FinishReason.STOP
        if self.num_tokens >= self.max_num_tokens:
            return FinishReason.LENGTH
        return None


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``[start, start + num_tokens)`` of one request; ``is_last`` -> sample after it."""

    request: Request
    start: int
    num_tokens: int

    @property
    def is_last(self) -> bool:
        return self.start + self.num_tokens == len(self.request.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_ids[self.start:self.start + self.num_tokens]


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs: at most one prefill chunk and one decode token per running request.

    ``decode`` is sorted by slot, so the rows it touches are ``[decode[0].slot, decode[-1].slot + 1)``.
    """

    prefill: PrefillChunk | None
    decode: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + (self.prefill.num_tokens if self.prefill else 0)

    @property
    def is_empty(self) -> bool:
        return self.prefill is None and not self.decode


@dataclass(frozen=True)
class Finished:
    """A request that left the scheduler in ``update_from_output``."""

    request: Request
    reason: FinishReason


class Scheduler:
    """Continuous batching: admission into free slots, chunked prefill within a budget, batched decode.

    Usage (the core thread's loop, one step)::

        out = scheduler.schedule()
        sampled = {...}  # request_id -> token id, for out.decode and a last prefill chunk
        finished = scheduler.update_from_output(out, sampled)

    Args:
        num_slots: KV slots (rows of the KV buffer), i.e. the most requests running at once.
        max_waiting: the bound of the waiting queue; ``add`` beyond it raises EngineOverloadedError.
        token_budget: tokens per step, decode tokens (one per running request) plus one prefill chunk.
    """

    def __init__(self, num_slots: int, max_waiting: int, token_budget: int) -> None:
        if token_budget <= num_slots:
            raise ValueError(f"token_budget must be > num_slots ({num_slots}), got {token_budget}")
        self.num_slots = num_slots
        self.max_waiting = max_waiting
        self.token_budget = token_budget
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # admission order (dicts keep insertion order)
        self._free_slots: list[int] = list(range(num_slots))  # a heap: lowest free slot first
        self._by_slot: list[Request | None] = [None] * num_slots

    # -- requests in and out ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; raises EngineOverloadedError when ``max_waiting`` are already waiting."""
        if len(self.waiting) >= self.max_waiting:
            raise EngineOverloadedError()
        self.waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Drop requests wherever they are, freeing their slots at once. Unknown ids are ignored."""
        ids = set(request_ids)
        dropped = [r for r in self.waiting if r.request_id in ids]
        if dropped:
            self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for request_id in ids:
            request = self.running.get(request_id)
            if request is not None:
                self._release(request)
                dropped.append(request)
        return dropped

    def abort_all(self) -> list[Request]:
        return self.abort([r.request_id for r in self.waiting] + list(self.running))

    # -- one step --------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Admit waiting requests into free slots, then pick this step's decode batch and prefill chunk.

        NOTE(engine): there are no phases: every running request in decode gets its one token, and what
        is left of the budget goes to the oldest request still in prefill (one per step).
        """
        # 1. Admission: FIFO into the lowest free slots.
        while self.waiting and self._free_slots:
            request = self.waiting.popleft()
            request.slot = heapq.heappop(self._free_slots)
            self._by_slot[request.slot] = request
            self.running[request.request_id] = request
        # 2. Decode: one token for each request past its prompt, in slot order.
        decode = tuple(r for r in self._by_slot if r is not None and not r.in_prefill)
        # 3. Prefill: one chunk of the oldest admitted request still in its prompt.
        prefill = None
        budget = self.token_budget - len(decode)
        for request in self.running.values():
            if request.in_prefill:
                start = request.num_computed_tokens
                prefill = PrefillChunk(request, start, min(len(request.prompt_ids) - start, budget))
                break
        if prefill is not None and prefill.request.first_scheduled_s is None:
            prefill.request.first_scheduled_s = time.monotonic()
        return SchedulerOutput(prefill, decode)

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[str, int],
                           complete: Collection[str] = ()) -> list[Finished]:
        """Advance the requests of ``out`` by what ran; append sampled tokens; free finished slots.

        Args:
            out: the step that ran.
            sampled: request_id -> token id for every request in ``out.decode`` and for the prefill
                request when its chunk was the last of the prompt.
            complete: requests whose output is complete after this token (their grammar allows nothing
                more): they finish with STOP, whatever else holds.
        Returns:
            The requests that finished in this step (their slots are already free).
        """
        finished: list[Finished] = []
        if out.prefill is not None:
            request = out.prefill.request
            request.num_computed_tokens += out.prefill.num_tokens
            if out.prefill.is_last:
                reason = self._append(request, sampled[request.request_id], complete)
                if reason is not None:
                    finished.append(Finished(request, reason))
        for request in out.decode:
            request.num_computed_tokens += 1
            reason = self._append(request, sampled[request.request_id], complete)
            if reason is not None:
                finished.append(Finished(request, reason))
        for item in finished:
            self._release(item.request)
        return finished

    # -- state -----------------------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def slot_owner(self, slot: int) -> Request | None:
        return self._by_slot[slot]

    def _append(self, request: Request, token_id: int, complete: Collection[str]) -> FinishReason | None:
        request.output_ids.append(token_id)
        if complete and request.request_id in complete:
            return FinishReason.STOP
        return request.check_stop(token_id)

    def _release(self, request: Request) -> None:
        if self.running.pop(request.request_id, None) is None:
            return
        assert request.slot is not None
        self._by_slot[request.slot] = None
        heapq.heappush(self._free_slots, request.slot)
