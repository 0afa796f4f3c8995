"""Slot-level prefix reuse: what each free KV slot still holds, and which slot a new prompt should take.

Pure Python (no numpy, no onnxruntime); the scheduler asks, the core performs the copies it returns.

NOTE(engine): the KV cache is one max-length row per slot (engine/kv_cache.py), so reuse works as in
llama.cpp's server (``--cache-reuse``/slot similarity): a finished request leaves its tokens with its slot,
and a new request takes the free slot whose tokens share the longest prefix with its prompt, then prefills
only the rest. Blocks (vLLM's paged KV) would need a paged attention kernel that ORT's GroupQueryAttention
doesn't have. Where the rows are host memory the longest prefix can also come from another slot (a
running request's prompt, another free slot): its positions are copied into the chosen slot before the
step runs. Opaque device buffers (WebGPU) can't be sliced from the host, so there a slot reuses only what
it holds itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Opaque rows (no copies): a free slot is taken for its cached prefix only when the prompt keeps at least this
# share of what the slot holds; otherwise a shorter match would throw away a longer cache (e.g. two
# conversations sharing only the chat template's first tokens), and the prompt goes to an empty or the least
# recently used slot.
MIN_KEEP_FRACTION = 0.5


# NOTE(engine): at least the last two prompt tokens run again, even when the cache holds more: the last one
# for the logits the first output token is sampled from, and one more so that run has S >= 2 rows, as a cold
# prefill's last chunk has (the scheduler never leaves a 1-token last chunk). INT4 models that quantize
# activations to int8 compute one row (MatMulNBits' M = 1 path) with other rounding than several (up to ~0.3
# in the logits on SmolLM2); this way a reused prompt gives bit-identical logits to a cold one.
MIN_RECOMPUTED = 2

# NOTE(engine): on a runner whose new prompts run together (``RowChunks.prompts``: one launch-bound run for every
# prompt a step admits, CUDA), a reused prefix takes its prompt out of that run: the rest runs alone as a chunk
# after a past (1-2 uncaptured runs, each costing about the same whatever its length), and a copy brings the prefix
# over (docs/perf/GPU.md). Shorter matches than this are not worth it there: the bench's distinct prompts shared
# 1-3 tokens with a running request nearly every time, and each admission paid a copy and two runs.
MIN_REUSE_BATCHED_PROMPTS = 64


@dataclass(frozen=True)
class KVCopy:
    """Copy KV positions ``[start, end)`` of slot ``src`` into slot ``dst`` (before the step's runs)."""

    src: int
    dst: int
    start: int
    end: int


@dataclass(frozen=True)
class Placement:
    """Where a prompt goes: ``slot`` holds its first ``num_reused`` tokens once ``copy`` (if any) ran."""

    slot: int
    num_reused: int = 0
    copy: KVCopy | None = None
    # low_slots: what ``slot`` cached is first saved to another free slot (runs before ``copy``)
    save: KVCopy | None = None


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``.

    List slices compare in C: one comparison when the prefixes agree, else a binary search (O(n log n)
    element compares in C rather than n Python steps).
    """
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SlotPrefixCache:
    """The tokens whose KV each free slot still holds, with least-recently-used order.

    Args:
        num_slots: rows of the KV buffer.
        enabled: False -> nothing is kept, every prompt goes to the lowest free slot (the old behaviour).
        can_copy: a prefix can be copied from another slot (host rows, or a device row copier).
        low_slots: a request always takes the lowest free slot (its prefix is copied there from wherever it
            is): a bucketed whole-buffer runner decodes rows ``[0, b)``, so low rows keep ``b`` small.
        min_reuse: the shortest prefix worth reusing; shorter matches count as none (1: any match).
    """

    def __init__(self, num_slots: int, enabled: bool, can_copy: bool, low_slots: bool = False,
                 min_reuse: int = 1) -> None:
        self.enabled = enabled
        self.min_reuse = max(1, min_reuse)
        self.can_copy = can_copy and enabled
        self.low_slots = low_slots
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]  # valid KV of each free slot
        self._last_used = [0] * num_slots
        self._clock = 0

    def cached(self, slot: int) -> list[int]:
        """The tokens whose KV the (free) slot holds."""
        return self._tokens[slot]

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the free slots still hold, all slots together (a taken slot counts 0: ``drop``)."""
        return sum(len(tokens) for tokens in self._tokens)

    def keep(self, slot: int, tokens: list[int]) -> None:
        """A request left ``slot``; the KV of ``tokens`` (its prompt and computed output) stays valid there."""
        self._clock += 1
        self._tokens[slot] = tokens if self.enabled else []
        self._last_used[slot] = self._clock

    def drop(self, slot: int) -> None:
        """The slot's KV is no longer what its tokens say (a failed run, or a request took it)."""
        self._tokens[slot] = []

    def victim(self, free: Iterable[int]) -> int:
        """The free slot to fill when no cached prefix is worth keeping: an empty one (lowest first), else the
        least recently used (the lowest with ``low_slots``)."""
        if self.low_slots:
            return min(free)
        return min(free, key=lambda s: (bool(self._tokens[s]), self._last_used[s], s))

    def place(self, prompt: Sequence[int], free: Sequence[int],
              running: Iterable[tuple[int, Sequence[int], int]] = ()) -> Placement:
        """Choose a free slot for ``prompt`` and how much of it is already computed there.

        Args:
            prompt: the new request's prompt ids.
            free: the free slots (non-empty).
            running: (slot, token ids, number of them with valid KV) of the running requests: copy sources.
        Returns:
            The placement; ``num_reused <= len(prompt) - 2`` (see MIN_RECOMPUTED).
        """
        if not self.enabled:
            return Placement(min(free))
        limit = len(prompt) - MIN_RECOMPUTED
        # NOTE(engine): a prompt too short to reuse min_reuse tokens matches nothing anywhere: no comparisons (a
        # burst of short prompts onto a batched-prompt runner otherwise compares each with every slot and row)
        matchable = limit >= self.min_reuse
        own = {s: self._worth(common_prefix_len(prompt, self._tokens[s], limit)) if matchable else 0 for s in free}
        save = self._save_lowest(free, own) if self.low_slots and self.can_copy else None
        best = max(free, key=lambda s: (own[s], -s))
        victim = self.victim(free)
        # NOTE(engine): taking a slot in place discards what it holds past the match. With host rows the match
        # can be copied instead, so a slot is taken in place only when the prompt extends all of it (the next
        # turn of its conversation); with opaque rows, when the prompt keeps most of it.
        keep = len(self._tokens[best]) if self.can_copy else MIN_KEEP_FRACTION * len(self._tokens[best])
        slot = best if own[best] > 0 and own[best] >= keep and not (self.low_slots and self.can_copy) else victim
        reused = own[slot]
        if not self.can_copy:
            return Placement(slot, reused)
        # NOTE(engine): a longer prefix elsewhere (a running request, another free slot) is copied over:
        # a host row copy costs far less than computing the same positions.
        src, longest = slot, reused
        for s in free:
            if s != slot and own[s] > longest:
                src, longest = s, own[s]
        for s, tokens, num_valid in running if matchable else ():
            n = self._worth(common_prefix_len(prompt, tokens, min(limit, num_valid)))
            if n > longest:
                src, longest = s, n
        if src == slot:
            return Placement(slot, reused, save=save)
        return Placement(slot, longest, KVCopy(src, slot, reused, longest), save)

    def _worth(self, num_matched: int) -> int:
        """A match's reusable length: itself, or 0 below ``min_reuse``."""
        return num_matched if num_matched >= self.min_reuse else 0

    def _save_lowest(self, free: Sequence[int], own: dict[int, int]) -> KVCopy | None:
        """low_slots: the lowest free slot is taken; what it caches beyond the new prompt's match moves to the
        free slot the victim rule picks among the others (an empty one, else the least recently used), so a
        conversation's KV survives another request taking its row (one at least ``min_reuse`` long: a shorter one
        is never reused)."""
        lowest = min(free)
        tokens = self._tokens[lowest]
        # NOTE(engine): a row shorter than min_reuse can never be reused, so it is not worth a copy (on WebGPU a
        # row copy is queued device work the next runs wait for: 6 of them stalled the first steps of a burst)
        if len(free) < 2 or len(tokens) < self.min_reuse or own[lowest] >= len(tokens):
            return None
        others = [s for s in free if s != lowest]
        spare = min(others, key=lambda s: (bool(self._tokens[s]), self._last_used[s], s))
        self._tokens[spare], self._last_used[spare] = tokens, self._last_used[lowest]
        own[spare] = own[lowest]
        return KVCopy(lowest, spare, 0, len(tokens))
