"""perf/gpu/gaps.py: a report's largest token gaps, each beside the engine steps that overlap it."""

from __future__ import annotations

import pytest

from perf.gpu import gaps


def _report(started: float) -> dict:
    # request 0: chunks at +0.10, +0.11, +0.19 (an 80 ms gap), +0.20; request 1 at +0.05 and +0.07
    return {"runs": [{"key": "c=2", "started_at_s": started, "records": [
        {"index": 0, "start_ms": 50.0, "ttft_ms": 50.0, "itl_ms": [10.0, 80.0, 10.0]},
        {"index": 1, "start_ms": 0.0, "ttft_ms": 50.0, "itl_ms": [20.0]},
        {"index": 2, "start_ms": 0.0, "ttft_ms": None, "itl_ms": []},  # failed before its first token
    ]}]}


def test_token_times_are_the_wall_clock_of_each_chunk() -> None:
    record = _report(1000.0)["runs"][0]["records"][0]
    assert gaps.token_times(record, 1000.0) == pytest.approx([1000.10, 1000.11, 1000.19, 1000.20])
    assert gaps.token_times({"ttft_ms": None}, 1000.0) == []


def test_the_largest_gap_is_explained_by_the_step_inside_it() -> None:
    report = _report(1000.0)
    trace = [
        {"t": 1000.105, "ms": 4.0, "idle_ms": 0.1, "decode": 2, "prefill": [], "phases_ms": {}},  # before the gap
        {"t": 1000.111, "ms": 75.0, "idle_ms": 0.2, "decode": 1, "prefill": [50], "phases_ms": {}},  # inside it
        {"t": 1000.150, "gc": 2, "ms": 3.0, "thread": "MainThread"},
        {"t": 1000.160, "lag": True, "ms": 12.0, "proc": "server"},
        {"t": 1000.300, "ms": 2.0, "idle_ms": 0.1, "decode": 1, "prefill": [], "phases_ms": {}},  # long after
    ]
    top = gaps.largest_gaps(report, 2)
    assert [(g["request"], g["token"], g["ms"]) for g in top] == [(0, 2, pytest.approx(80.0)),
                                                                  (1, 1, pytest.approx(20.0))]
    first = gaps.explain(report, trace, 1)[0]
    assert first["longest_step_ms"] == 75.0 and first["gc_ms"] == 3.0 and first["loop_lag_ms"] == 12.0
    assert [r.get("ms") for r in first["trace"]] == [4.0, 75.0, 3.0, 12.0]  # a step ending within 5 ms before counts
    assert first["trace"][1]["at_ms"] == pytest.approx(1.0)
    assert first["at_s"] == pytest.approx(0.11)


def test_a_report_without_its_start_is_refused() -> None:
    report = _report(1000.0)
    report["runs"][0]["started_at_s"] = None
    with pytest.raises(ValueError, match="started_at_s"):
        gaps.largest_gaps(report, 1)


def test_a_trace_reads_the_same_plain_and_gzipped(tmp_path) -> None:
    import gzip
    import json

    lines = [{"t": 1.0, "ms": 2.0, "decode": 1}, {"t": 1.5, "gc": 0, "ms": 0.1}, {"t": 2.0, "lag": True, "ms": 6.0}]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    (tmp_path / "t.jsonl").write_text(text)
    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as f:
        f.write(text)
    assert gaps.read_trace(tmp_path / "t.jsonl") == gaps.read_trace(tmp_path / "t.jsonl.gz") == lines
