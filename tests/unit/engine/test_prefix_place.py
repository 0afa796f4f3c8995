"""SlotPrefixCache.place for prompts too short to reuse anything (min_reuse, as on batched-prompt runners): placed as
a search would place them (the lowest free slot, nothing reused or copied), without comparing the prompt with any
slot or running row; longer prompts are still compared and reuse what matches."""

from __future__ import annotations

import random

import pytest

from engine import prefix_cache
from engine.prefix_cache import MIN_RECOMPUTED, SlotPrefixCache

MIN_REUSE = 64


def _filled(rng: random.Random) -> SlotPrefixCache:
    cache = SlotPrefixCache(16, enabled=True, can_copy=True, low_slots=True, min_reuse=MIN_REUSE)
    for slot in range(16):
        cache.keep(slot, [rng.randrange(1000) for _ in range(100)])
    return cache


@pytest.mark.parametrize("prompt_len", [5, 20, 60, 65, 66, 80, 100])
def test_a_short_prompt_needs_no_comparison_and_a_long_one_reuses(prompt_len: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _filled(random.Random(7))
    prompt = cache.cached(5)[:prompt_len]  # all of it is what slot 5 holds
    calls = []
    real = prefix_cache.common_prefix_len
    monkeypatch.setattr(prefix_cache, "common_prefix_len", lambda *a: calls.append(a) or real(*a))
    placed = cache.place(prompt, list(range(3, 16)), iter([(0, cache.cached(0), 100)]))
    if prompt_len - MIN_RECOMPUTED < MIN_REUSE:
        assert not calls
        assert (placed.slot, placed.num_reused, placed.copy) == (3, 0, None)
    else:
        assert calls
        assert placed.slot == 3 and placed.num_reused == prompt_len - MIN_RECOMPUTED
        assert placed.copy is not None and placed.copy.src == 5
