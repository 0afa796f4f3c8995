"""perf.op_profile.summarize: per-op-type figures from hand-built profiler events."""

from __future__ import annotations

import pytest

from perf.op_profile import summarize


def _run(ts: int, dur: int) -> dict:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}


def _node(name: str, op: str, ts: int, dur: int) -> dict:
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_per_op_figures_leave_out_the_warm_up_runs() -> None:
    events = [_run(0, 900), _node("a", "MatMulNBits", 1, 800)]  # the warm-up run: left out
    for i, ts in enumerate((1000, 2000)):
        events += [_run(ts, 100 + i * 20), _node("a", "MatMulNBits", ts + 1, 60), _node("b", "Add", ts + 2, 10),
                   _node("c", "Add", ts + 3, 10)]
    got = summarize(events, warmup_runs=1)
    assert got["runs"] == 2
    assert got["run_us_median"] == 110
    assert got["nodes_per_run"] == 3
    assert got["node_us_per_run"] == 80
    assert got["ops"] == {"MatMulNBits": {"us": 60, "nodes": 1, "share": 0.75},
                          "Add": {"us": 20, "nodes": 2, "share": 0.25}}
    assert got["top_nodes"][0] == ["a", 60]


def test_too_few_runs_is_an_error_naming_them() -> None:
    with pytest.raises(ValueError, match="2 profiled runs"):
        summarize([_run(0, 1), _run(1, 1)], warmup_runs=2)


def test_spec_cost_counts_checks_in_decode_steps() -> None:
    from perf.spec_cost import tokens_per_step

    counts = {"tokens": 20, "decode": 10, "checks": {2: 2, 4: 1}}
    # checks of 2 cost 1.5 steps, of 4 interpolated between 3 (2.0) and 5 (3.0): 2.5; 10 + 3 + 2.5 = 15.5 steps
    assert tokens_per_step(counts, {1: 1.0, 2: 1.5, 3: 2.0, 5: 3.0}) == 20 / 15.5
