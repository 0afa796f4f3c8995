"""Token-budget continuous batching over a fixed set of KV slots (rows of the shared KV buffer), with prefix
reuse across requests, n > 1 choices sharing one prefill, and prompt-lookup drafts for speculative decoding.

Pure Python: owns the waiting queue, slot assignment (engine/prefix_cache.py picks the slot), stop checks
and drafts (engine/speculative.py); must not import onnxruntime or numpy. It decides; the core runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.prefix_cache import KVCopy, SlotPrefixCache
from engine.row_holds import RowHolds
from engine.spec_decode.policy import ModelDraftState, choose_drafts
from engine.spec_decode.proposer import DRAFT_MODEL, NGRAM, DraftRow, NgramProposer
from engine.speculative import CheckCost, NgramDrafter
from engine.types import EngineOverloadedError, FinishReason, SamplingParams

# NOTE(engine): a step's second and later prefill chunks that do not finish their prompt are at least this
# long: each chunk is a model run of its own, and a few tokens of a long prompt would cost a run for little.
MIN_EXTRA_CHUNK = 32
# The most prompt chunks of requests of priority > 0 (batch lines) in one step.
LOW_PRIORITY_PREFILLS = 1


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
    index: int = 0  # the choice (n > 1: 0..n-1, all under one request_id)
    # n > 1: on choice 0, the other choices. They are admitted with it, wait while it prefills the prompt
    # (their rows get the same KV: copied, or computed alongside), then sample from its last logits.
    forks: list[Request] = field(default_factory=list)
    parent: Request | None = None  # on a fork: choice 0
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused at admission (usage.cached_tokens)
    drafter: NgramDrafter | None = None  # prompt-lookup drafts' state (scheduler-owned), None = none yet
    model_draft: ModelDraftState | None = None  # the draft model's drafts' state (scheduler-owned), None = none yet
    shadow_draft: tuple[int, ...] = ()  # what prompt lookup would have drafted beside a draft model's draft (scored)
    # 0: interactive. A request of a higher number (a batch line) is admitted after every lower one waiting, and
    # gives its slot up to one that finds no free slot (recompute preemption: ``Scheduler._preempt``).
    priority: int = 0
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        # Prompt + output never passes the context; max_tokens caps the output.
        self.max_num_tokens = min(len(self.prompt_ids) + self.params.max_tokens, self.max_model_len)
        self._stop_ids = frozenset(self.params.stop_token_ids) | (
            frozenset() if self.params.ignore_eos else self.eos_token_ids
        )

    @property
    def key(self) -> tuple[str, int]:
        """(request_id, choice index): unique among the requests the scheduler holds."""
        return self.request_id, self.index

    def fork(self, n: int) -> list[Request]:
        """Make choices 1..n-1 of this request (n > 1); they are kept in ``forks``. Their ``sampler_state``
        is left to the caller."""
        self.forks = [Request(self.request_id, self.prompt_ids, self.params, self.eos_token_ids,
                              self.max_model_len, arrival_s=self.arrival_s, seq=self.seq, index=i, parent=self)
                      for i in range(1, n)]
        return self.forks

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def computed_ids(self) -> list[int]:
        """The tokens whose KV is in the slot."""
        n = self.num_computed_tokens
        if n <= len(self.prompt_ids):
            return self.prompt_ids[:n]
        return self.prompt_ids + self.output_ids[:n - len(self.prompt_ids)]

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


def _priority(request: Request) -> int:
    return request.priority


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
class Verify:
    """A request in decode that checks a draft this step: one run of ``[last token, *draft]`` in its slot.

    ``draft_probs``: float ``[len(draft), vocab]``, the distribution each draft token was drawn from (a draft model's
    sampled draft), or None (prompt lookup, greedy drafts); ``source``: which proposer made it
    (``engine.spec_decode.proposer``)."""

    request: Request
    draft: tuple[int, ...]
    draft_probs: Any = None
    source: str = NGRAM

    @property
    def token_ids(self) -> list[int]:
        return [self.request.last_token_id, *self.draft]


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs: KV copies first, then one decode token per running request (batched, or a
    draft check of its own in ``verify``), then prefill chunks of requests still in their prompt.

    ``prefill`` is the first prefill chunk (the oldest request's) and ``more_prefills`` the chunks of younger
    requests that fit in the same step's token budget; ``prefills`` is all of them, in order. Each chunk
    is its own model run (GroupQueryAttention takes S > 1 new tokens with a past only at batch 1).

    ``decode`` is sorted by slot, so the rows it touches are ``[decode[0].slot, decode[-1].slot + 1)``.
    """

    prefill: PrefillChunk | None
    decode: tuple[Request, ...]
    verify: tuple[Verify, ...] = ()
    copies: tuple[KVCopy, ...] = ()  # run in order, before any model run of the step
    more_prefills: tuple[PrefillChunk, ...] = ()  # chunks of other requests after ``prefill``, oldest first
    # (slot, valid KV positions) of the rows preempted requests gave up this step: the runner releases them first
    released: tuple[tuple[int, int], ...] = ()
    # rows the draft model drafts for this step (the core runs it, then checks each draft as a ``Verify``)
    draft_rows: tuple[DraftRow, ...] = ()

    @property
    def prefills(self) -> tuple[PrefillChunk, ...]:
        """Every prefill chunk of the step, oldest request first."""
        return (self.prefill, *self.more_prefills) if self.prefill is not None else self.more_prefills

    @property
    def num_tokens(self) -> int:
        return (len(self.decode) + sum(len(v.draft) + 1 for v in self.verify)
                + sum(r.num_tokens + 1 for r in self.draft_rows) + sum(c.num_tokens for c in self.prefills))


@dataclass(frozen=True)
class Finished:
    """A request that left the scheduler in ``update_from_output``."""

    request: Request
    reason: FinishReason


def _score_shadow(request: Request, tokens: list[int]) -> None:
    """Scores what prompt lookup would have drafted beside a draft model's checked draft (then forgets it)."""
    if request.shadow_draft and request.drafter is not None:
        request.drafter.record_shadow(request.shadow_draft, tokens)
    request.shadow_draft = ()


def _victim(running: Iterable[Request], priority: int) -> Request | None:
    """The running request a waiting one of ``priority`` may preempt: of the highest priority number above it,
    the one admitted last (it has the least work to redo); never one with n > 1 choices."""
    victim = None
    for request in running:
        if (request.priority > priority and not request.forks and request.parent is None
                and (victim is None or request.priority >= victim.priority)):
            victim = request
    return victim


class Scheduler:
    """Continuous batching: admission into free slots, chunked prefill within a budget, batched decode.

    Usage (the core thread's loop, one step)::

        out = scheduler.schedule()
        ...  # run out.copies, out.decode, out.verify and out.prefills
        sampled = {...}  # Request -> its new token ids, for out.decode, out.verify and a last prefill chunk
        finished = scheduler.update_from_output(out, sampled)

    Slots: a slot is one KV row. A finished request leaves its computed tokens with its slot (prefix reuse,
    see engine/prefix_cache.py); a new request takes the free slot whose tokens share the longest prefix with
    its prompt (or an empty / least recently used one) and starts with ``num_computed_tokens`` = that prefix.

    Args:
        num_slots: KV slots (rows of the KV buffer), i.e. the most requests running at once.
        max_waiting: the bound of the waiting queue; ``add`` beyond it raises EngineOverloadedError.
        token_budget: tokens per step, decode tokens (one per running request) plus prefill chunks.
        prefix_caching: keep finished requests' KV and reuse the longest matching prefix.
        can_copy: prefixes may be copied between slots (host rows or a device row copier; else only a slot's own).
        low_slots: every request takes the lowest free slot (a bucketed whole-buffer runner: see SlotPrefixCache).
        speculative_tokens: the longest draft (0: no speculative decoding).
        speculative_max_batch: draft only while at most this many requests decode (a draft check runs alone:
            GroupQueryAttention takes S > 1 new tokens with a past at batch 1 only).
        max_prefills: the most requests whose prompt chunks run in one step (0: as many as the budget holds;
            1: the oldest request's only, one step each).
        min_prefix_reuse: the shortest cached prefix worth reusing (see ``SlotPrefixCache``).
        prompt_budget: tokens of new requests' whole prompts (no reused prefix, no other choices, 2 to
            ``batched_prompt_len`` tokens) a step takes beside ``token_budget``: the core runs them together
            (``EngineCore._run_prompts``); 0: none beside it.
        batched_prompt_len: the longest prompt that counts against ``prompt_budget``.

    A draft model drafts for rows too once ``use_draft_model`` says so.
    """

    def __init__(self, num_slots: int, max_waiting: int, token_budget: int, *, prefix_caching: bool = False,
                 can_copy: bool = False, speculative_tokens: int = 0, speculative_max_batch: int = 1,
                 low_slots: bool = False, max_prefills: int = 0, min_prefix_reuse: int = 1, prompt_budget: int = 0,
                 batched_prompt_len: int = 0) -> None:
        if token_budget <= num_slots:
            raise ValueError(f"token_budget must be > num_slots ({num_slots}), got {token_budget}")
        self.num_slots = num_slots
        self.max_waiting = max_waiting
        self.token_budget = token_budget
        self.speculative_tokens = max(0, min(speculative_tokens, token_budget - 2))
        self.speculative_max_batch = speculative_max_batch
        self.draft_max = 0  # the longest draft of the draft model (0: none: use_draft_model)
        self.ngram = NgramProposer()
        self.check_cost = CheckCost()  # a draft check's cost on this device, measured by the core (every drafter's)
        self.max_prefills = max_prefills if max_prefills > 0 else num_slots
        self.prompt_budget = prompt_budget if batched_prompt_len >= 2 else 0
        self.batched_prompt_len = batched_prompt_len
        # NOTE(engine): ordered by priority, then arrival (a preempted request goes first among its priority)
        self.waiting: deque[Request] = deque()
        self._num_low_waiting = 0  # of them, requests of priority > 0 (they do not count against max_waiting)
        self.running: dict[tuple[str, int], Request] = {}  # by Request.key, in admission order
        self.num_preemptions_total = 0
        self.cache = SlotPrefixCache(num_slots, enabled=prefix_caching, can_copy=can_copy, low_slots=low_slots,
                                     min_reuse=min_prefix_reuse)
        self._free: set[int] = set(range(num_slots))
        self.holds = RowHolds() if num_slots > 1 else RowHolds(0.0)  # the last interactive row, kept a while
        self._by_slot: list[Request | None] = [None] * num_slots
        self.prefix_queries_total = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits_total = 0  # of them, tokens whose KV was reused

    # -- requests in and out ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request (with its ``forks``); raises EngineOverloadedError when ``max_waiting`` interactive
        requests wait (requests of priority > 0 are bounded by their sender: a batch keeps a few lines in flight)."""
        if request.priority == 0 and len(self.waiting) - self._num_low_waiting >= self.max_waiting:
            raise EngineOverloadedError()
        if len(request.forks) + 1 > self.num_slots:
            raise ValueError(f"{len(request.forks) + 1} choices need as many slots; there are {self.num_slots}")
        self._queue(request)

    def _queue(self, request: Request, first: bool = False) -> None:
        """Into the waiting queue after every request of its priority or lower (``first``: before those of its own
        priority)."""
        waiting = self.waiting
        if request.priority:
            self._num_low_waiting += 1
        if not first and (not waiting or waiting[-1].priority <= request.priority):
            waiting.append(request)
            return
        i = len(waiting)
        while i > 0 and (waiting[i - 1].priority > request.priority
                         or (first and waiting[i - 1].priority == request.priority)):
            i -= 1
        waiting.insert(i, request)

    def abort(self, request_ids: Iterable[str], index: int | None = None) -> list[Request]:
        """Drop requests (every choice, or only choice ``index``) wherever they are, freeing their slots at
        once. Unknown ids are ignored."""
        ids = set(request_ids)
        dropped: list[Request] = []
        if index in (None, 0):
            dropped = [r for r in self.waiting if r.request_id in ids]
            if dropped:
                self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
                self._num_low_waiting -= sum(1 for r in dropped if r.priority)
        for request in [r for r in self.running.values()
                        if r.request_id in ids and (index is None or r.index == index)]:
            self._release(request)
            dropped.append(request)
        return dropped

    def abort_all(self) -> list[Request]:
        return self.abort({r.request_id for r in self.waiting} | {r.request_id for r in self.running.values()})

    # -- one step --------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Admit waiting requests into free slots, then pick this step's decode batch, drafts and prefill chunk.

        NOTE(engine): there are no phases: every running request in decode gets its one token (or checks a
        draft), and what is left of the budget goes to the requests still in their prompt, oldest first, a
        chunk each (as vLLM's scheduler gives prefills what decode leaves): requests that arrive together get
        their first tokens in the same step instead of one step each behind the running streams.
        """
        # 1. Admission, by priority then FIFO: each request into the slot the prefix cache picks; a request with n
        #    choices waits until n slots are free (and holds the queue meanwhile, so it can't starve). One that
        #    finds no free slot takes the slot of a running request of a higher priority number (preemption).
        copies: list[KVCopy] = []
        released: list[tuple[int, int]] = []
        now = time.monotonic()
        while self.waiting:
            head = self.waiting[0]
            free = self.holds.open_to_batch(self._free, now) if head.priority else sorted(self._free)
            if len(free) > len(head.forks):
                self._admit(self.waiting.popleft(), copies, free)
                if head.priority:
                    self._num_low_waiting -= 1
                continue
            victim = _victim(self.running.values(), head.priority)
            if victim is None:
                break
            released.append(self._preempt(victim))
        # 2. Decode: one token for each request past its prompt, in slot order; alone, it may check a draft.
        #    NOTE(engine): while an interactive request computes its prompt, requests of a higher priority number
        #    (batch lines) sit the step out, decode and prompt alike: the step is the interactive prompt's alone,
        #    as on an idle server, so a batch costs an arriving request's first token no more than the step that
        #    was running when it came.
        yielding = any(r.priority for r in self.running.values())
        urgent = yielding and any(r.priority == 0 and r.in_prefill for r in self.running.values())
        decode = tuple(r for r in self._by_slot if r is not None and not r.in_prefill
                       and not (urgent and r.priority))
        budget = self.token_budget - len(decode)
        verify: tuple[Verify, ...] = ()
        draft_rows: tuple[DraftRow, ...] = ()
        if (self.speculative_tokens or self.draft_max) and 0 < len(decode) <= self.speculative_max_batch:
            verify, draft_rows = self._drafts(decode, budget - 1)
            if verify or draft_rows:
                drafting = {id(v.request) for v in verify} | {id(d.request) for d in draft_rows}
                decode = tuple(r for r in decode if id(r) not in drafting)
                budget -= sum(len(v.draft) for v in verify) + sum(d.num_tokens for d in draft_rows)
        # 3. Prefill: a chunk of each admitted request still in its prompt, oldest first, while the budget
        #    lasts (forks wait for choice 0).
        #    New requests' whole short prompts take the prompt budget first, where there is one (run together).
        prefills = []
        prompt_budget = self.prompt_budget
        running: Iterable[Request] = self.running.values()
        if yielding:  # interactive prompts before batch lines'
            running = sorted(running, key=_priority)
        num_low = 0
        for request in running:
            if len(prefills) >= self.max_prefills or (budget <= 0 and prompt_budget <= 0):
                break
            if not request.in_prefill or request.parent is not None or (urgent and request.priority):
                continue
            if request.priority:
                # NOTE(engine): one batch line's prompt chunk per step (each chunk is a run of its own): steps stay
                # short, so an interactive request that arrives waits less for the step in flight
                if num_low >= LOW_PRIORITY_PREFILLS:
                    continue
                num_low += 1
            start = request.num_computed_tokens
            remaining = len(request.prompt_ids) - start
            if start == 0 and not request.forks and 2 <= remaining <= min(self.batched_prompt_len, prompt_budget):
                prefills.append(PrefillChunk(request, 0, remaining))
                prompt_budget -= remaining
                continue
            if budget <= 0:
                continue
            num = min(remaining, budget)
            if remaining - num == 1 and num > 1:
                num -= 1  # NOTE(engine): no 1-token last chunk (see prefix_cache.MIN_RECOMPUTED)
            if prefills and num < remaining and num < MIN_EXTRA_CHUNK:
                break  # NOTE(engine): a sliver of a younger prompt costs a model run for little progress
            prefills.append(PrefillChunk(request, start, num))
            budget -= num
        for chunk in prefills:
            if chunk.request.first_scheduled_s is None:
                chunk.request.first_scheduled_s = now
        return SchedulerOutput(prefills[0] if prefills else None, decode, verify, tuple(copies), tuple(prefills[1:]),
                               tuple(released), draft_rows)

    def _preempt(self, request: Request) -> tuple[int, int]:
        """Give ``request``'s slot up and queue it again, first among its priority; returns (slot, valid KV).

        NOTE(engine): recompute preemption, as vLLM's: the tokens it has so far (prompt and output) become its
        prompt, computed again when it is admitted again (from the longest prefix a free slot still holds: its own
        row, if no one took it). Its sampler, grammar and drafter keep their state; its output continues from the
        same token, and ``max_num_tokens`` (prompt + max_tokens) is unchanged.
        """
        slot, keep = request.slot, request.num_computed_tokens
        assert slot is not None
        self._release(request)
        request.prompt_ids = request.prompt_ids + request.output_ids
        request.output_ids = []
        request.slot = None
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._queue(request, first=True)
        return slot, keep

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[Request, int | Sequence[int]],
                           complete: Collection[Request] = ()) -> list[Finished]:
        """Advance the requests of ``out`` by what ran; append sampled tokens; free finished slots.

        Args:
            out: the step that ran.
            sampled: Request -> its new token id(s): one for each request in ``out.decode``, one for each prefill
                request and each of its forks whose chunk was the prompt's last, and for each verify the
                tokens its check produced (the accepted draft prefix plus the model's own next token).
            complete: requests whose output is complete after their last token of the step (their grammar allows
                nothing more): they finish with STOP, whatever else holds.
        Returns:
            The requests that finished in this step (their slots are already free).
        """
        finished: list[Finished] = []

        def advance(request: Request, tokens: int | Sequence[int]) -> None:
            tokens = [tokens] if isinstance(tokens, int) else tokens
            last = len(tokens) - 1
            for i, token_id in enumerate(tokens):
                request.num_computed_tokens += 1  # NOTE(engine): the token before it is now in the KV
                # NOTE(engine): a check's tokens: only the last can be the one after which the grammar is complete
                reason = self._append(request, token_id, complete if i == last else ())
                if reason is not None:
                    finished.append(Finished(request, reason))
                    return

        for chunk in out.prefills:
            request = chunk.request
            request.num_computed_tokens += chunk.num_tokens
            if chunk.is_last:
                for r in (request, *request.forks):  # the forks' rows hold the prompt's KV too by now
                    r.num_computed_tokens = len(r.prompt_ids) - 1  # advance() counts the last prompt token
                    r.first_scheduled_s = request.first_scheduled_s
                    advance(r, sampled[r])
        for request in out.decode:
            advance(request, sampled[request])
        for v in out.verify:
            tokens = sampled[v.request]
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            state = v.request.model_draft if v.source == DRAFT_MODEL else v.request.drafter
            if state is not None:
                state.record(len(v.draft), len(tokens) - 1)
            _score_shadow(v.request, tokens)
            advance(v.request, tokens)
        for item in finished:
            self._release(item.request)
        return finished

    # -- state -----------------------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def slot_owner(self, slot: int) -> Request | None:
        return self._by_slot[slot]

    def forget(self, slot: int) -> None:
        """Drop what a free slot's KV was said to hold (its last run failed midway)."""
        self.cache.drop(slot)

    def _admit(self, request: Request, copies: list[KVCopy], free: list[int]) -> None:
        """Into the slot of ``free`` (ascending) the prefix cache picks."""
        running = ((r.slot, r.computed_ids, r.num_computed_tokens) for r in self.running.values()
                   if r.num_computed_tokens > 0 and r.slot is not None)
        placement = self.cache.place(request.prompt_ids, free, running if self.cache.can_copy else ())
        if request.forks and not self.cache.can_copy and placement.num_reused:
            # NOTE(engine): the other choices' rows can't receive this prefix by copy (opaque KV): all rows
            # compute the prompt together from position 0 instead.
            placement = type(placement)(placement.slot)
        if placement.save is not None:  # before the prefix copy: it may overwrite the saved row
            copies.append(placement.save)
        if placement.copy is not None:
            copies.append(placement.copy)
        self._take(request, placement.slot)
        request.num_computed_tokens = placement.num_reused
        if not request.num_preemptions:  # usage counts the prompt's first admission
            request.num_cached_tokens = placement.num_reused
        self.prefix_queries_total += len(request.prompt_ids)
        self.prefix_hits_total += placement.num_reused
        for fork in request.forks:
            slot = self.cache.victim(set(free) & self._free)
            self._take(fork, slot)
            if placement.num_reused:
                copies.append(KVCopy(request.slot, slot, 0, placement.num_reused))

    def _take(self, request: Request, slot: int) -> None:
        self._free.discard(slot)
        self.cache.drop(slot)
        self.holds.taken(slot)
        request.slot = slot
        self._by_slot[slot] = request
        self.running[request.key] = request

    def use_draft_model(self, draft_max: int) -> None:
        """Rows may draft with the draft model too, at most ``draft_max`` tokens a draft: each step a row drafts with
        whichever source (prompt lookup, the draft model) is likelier to pay (``engine.spec_decode.policy``)."""
        self.draft_max = max(0, min(draft_max, self.token_budget - 2))

    def stop_drafts(self, request: Request) -> None:
        """``request`` drafts no more (its logits are not finite: ``EngineCore._check_finite``)."""
        if self.speculative_tokens:
            if request.drafter is None:
                request.drafter = NgramDrafter(self.speculative_tokens, cost=self.check_cost)
            request.drafter.stop()

    def _drafts(self, decode: tuple[Request, ...], budget: int) -> tuple[tuple[Verify, ...], tuple[DraftRow, ...]]:
        """Drafts for the requests in ``decode``, within ``budget`` draft tokens: prompt-lookup drafts to check, and
        the rows the draft model drafts for (run by the core); ``engine.spec_decode.policy.choose_drafts`` picks."""
        checks, rows = choose_drafts(decode, budget, self.ngram, self.speculative_tokens, self.draft_max,
                                     self.check_cost)
        return tuple(Verify(request, draft) for request, draft in checks), rows

    def _append(self, request: Request, token_id: int, complete: Collection[Request]) -> FinishReason | None:
        request.output_ids.append(token_id)
        if complete and request in complete:
            return FinishReason.STOP
        return request.check_stop(token_id)

    def _release(self, request: Request) -> None:
        if self.running.pop(request.key, None) is None:
            return
        assert request.slot is not None
        self._by_slot[request.slot] = None
        self._free.add(request.slot)
        self.cache.keep(request.slot, request.computed_ids)
        if request.priority == 0 and self.cache.enabled:
            self.holds.hold(request.slot, time.monotonic())
