"""The core's step counters (engine.step_stats): named phases in PHASES order, the decode rate's average."""

from __future__ import annotations

import pytest

from engine.step_stats import PHASES, PhaseTimes, StepStats


def test_phase_times_come_out_in_phases_order() -> None:
    phase = PhaseTimes()
    for i, name in enumerate(PHASES):
        setattr(phase, name, getattr(phase, name) + i + 1.0)
    assert phase.as_tuple() == tuple(float(i + 1) for i in range(len(PHASES)))


def test_decode_rate_is_an_exponential_average_and_idle_steps_count_only_as_steps() -> None:
    stats = StepStats()
    stats.record_step(10, 0.5)  # the first measurement is taken as is
    assert stats.decode_tokens_per_s == pytest.approx(20.0)
    stats.record_step(0, 0.5)  # no decode tokens: the rate stays
    stats.record_step(40, 0.5)  # 80 tok/s weighs 0.2
    assert stats.decode_tokens_per_s == pytest.approx(0.8 * 20.0 + 0.2 * 80.0)
    assert stats.steps_total == 3
