"""perf.spec_cost on the tiny model: every produced token is a decode run's or a check's."""

from __future__ import annotations

import asyncio
from pathlib import Path

from perf.spec_cost import check_costs, count_runs


def test_runs_are_counted_and_checks_timed(tiny_model: Path) -> None:
    got = asyncio.run(count_runs(tiny_model, requests=2, temperature=1.0, distinct=True, threads=1, max_tokens=24,
                                 words=20))
    assert got["tokens"] == 2 * 24
    num_checks = sum(got["checks"].values())
    # a decode run gives one token; a check of S (the last token and S - 1 drafted) gives 1 + those kept; the
    # first token of each request comes from its prompt
    assert got["decode"] + num_checks + got["accepted"] == got["tokens"] - 2
    assert sum((s - 1) * n for s, n in got["checks"].items()) == got["drafted"]
    costs = check_costs(tiny_model, [2, 3], threads=1, rounds=5, position=16)
    assert set(costs) == {1, 2, 3} and costs[1] == 1.0
