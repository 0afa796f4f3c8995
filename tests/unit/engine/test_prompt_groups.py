"""Batched prompt runs' row groups (engine.row_chunks.prompt_groups): neighbouring rows run together, and with prompt
shapes each range splits into warmed row counts (prompt_counts) in at most two runs."""

from __future__ import annotations

from engine.row_chunks import PROMPT_COUNT_STEP, prompt_counts, prompt_groups


def test_prompt_counts_are_one_to_the_step_then_its_multiples() -> None:
    assert prompt_counts(64) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64)
    assert prompt_counts(4) == (1, 2, 3, 4)
    assert prompt_counts(20) == (1, 2, 3, 4, 5, 6, 7, 8, 16)


def test_a_range_of_neighbouring_rows_runs_in_at_most_two_groups() -> None:
    counts = prompt_counts(64)
    for n in range(1, 65):
        slots = list(range(64 - n, 64))
        groups = prompt_groups(slots, counts)
        assert sum(k for _, k in groups) == n and all(k in counts for _, k in groups)
        assert len(groups) <= 2, (n, groups)
        assert [at for at, _ in groups] == [0] if len(groups) == 1 else [0, groups[0][1]]
    assert prompt_groups(list(range(33, 64)), counts) == [(0, 24), (24, 7)]  # 31 rows (powers of two: 5 runs)


def test_gaps_split_groups_and_without_counts_a_range_is_one_group() -> None:
    slots = [0, 1, 2, 5, 6, 9]
    assert prompt_groups(slots, None) == [(0, 3), (3, 2), (5, 1)]
    assert prompt_groups(slots, prompt_counts(64)) == [(0, 3), (3, 2), (5, 1)]
    wide = list(range(0, 40))
    assert prompt_groups(wide, None) == [(0, 40)]
    assert prompt_groups(wide, prompt_counts(64)) == [(0, 40)]
    assert prompt_groups(list(range(0, 2 * PROMPT_COUNT_STEP + 3)), prompt_counts(64)) == [(0, 16), (16, 3)]
