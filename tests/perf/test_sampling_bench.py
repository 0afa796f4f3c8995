"""perf/sampler.py on synthetic rows (no model): another checkout's sampler loads beside this tree's, and a
short run reports every route of every case."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import engine.sampler
import engine.sampling_fast
from perf import sampler as bench


def test_another_checkout_loads_beside_this_one():
    root = Path(__file__).resolve().parents[2]
    other = bench.load_sampler(root)
    assert other is not engine.sampler and other.RequestSampler is not engine.sampler.RequestSampler
    assert other.draw_tokens is not engine.sampler.draw_tokens  # its own engine.sampling_fast
    assert sys.modules["engine.sampling_fast"] is engine.sampling_fast and sys.modules["engine.sampler"] is engine.sampler


def test_a_revision_loads_without_a_checkout(tmp_path):
    tree, sha = bench.checkout_of("HEAD", tmp_path)
    assert tree == tmp_path and sha == bench.git_sha(Path(__file__).resolve().parents[2])
    other = bench.load_sampler(tree)
    assert other.__file__ == str(tmp_path / "engine" / "sampler.py") and hasattr(other, "sample_batch")


def test_a_short_run_reports_every_route(tmp_path):
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "sampler.json"
    assert bench.main(["--synthetic", "2048", "--rows", "16", "--rounds", "2", "--min-s", "0.001",
                       "--case", "temperature 1", "--case", "presence 0.5 + top_p 0.9", "--before", str(root),
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["case"] for r in report["results"]] == ["temperature 1", "presence 0.5 + top_p 0.9"]
    for r in report["results"]:
        assert r["model"] == "synthetic-2048" and r["vocab"] == 2048
        assert len(r["cpu_ms_per_row_rounds"]) == len(r["before_cpu_ms_per_row_rounds"]) == 2
        assert r["cpu_ms_per_row"] > 0 and r["before_cpu_ms_per_row"] > 0 and r["reference_cpu_ms_per_row"] > 0
        assert len(r["after_over_before_rounds"]) == 2
