"""`ortserve bench` end to end (bench.cli.main) against the streaming peer: report, plot, compare."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cli import main
from bench.report import load_report

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[3]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(peer, tmp_path: Path, name: str, model: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    rc = main(["--url", peer.url, "--model", model, "--label", name, "--num-requests", "6",
               "--prompt-tokens", "16", "--output-tokens", "8", "--warmup", "1", "--no-progress",
               "--api-key", "sk-secret-for-test", "--out", str(out), *extra])
    assert rc == 0
    return load_report(out)


def test_report_has_settings_revision_machine_figures_and_raw_timings(peer, tmp_path, capsys):
    plot = tmp_path / "a.png"
    report = bench(peer, tmp_path, "A", "peer;ttft=0.02;itl=0.01;tag=101", "--concurrency", "1,3",
                   "--slo-ttft-ms", "1000", "--plot", str(plot))
    printed = capsys.readouterr().out
    assert re.search(r"^c=1: 6/6 ok", printed, re.M) and re.search(r"^c=3: 6/6 ok", printed, re.M)
    assert report["label"] == "A" and report["settings"]["concurrency"] == [1, 3]
    assert report["settings"]["model"] == "peer;ttft=0.02;itl=0.01;tag=101"
    assert "sk-secret-for-test" not in json.dumps(report)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert report["git"]["sha"] == head
    assert report["machine"]["num_cpus_logical"] >= 1 and report["machine"]["cpu_model"]
    assert [run["key"] for run in report["runs"]] == ["c=1", "c=3"]
    for run in report["runs"]:
        s = run["summary"]
        assert s["num_ok"] == 6 and s["num_output_tokens"] == 48
        assert s["goodput"]["slo_ttft_ms"] == 1000
        assert s["goodput"]["num_met"] == sum(r["ttft_ms"] <= 1000 for r in run["records"])
        assert len(run["records"]) == 6 and all(len(r["itl_ms"]) == 7 for r in run["records"])
        # The summary is recomputable from the raw records it ships with.
        ttfts = sorted(r["ttft_ms"] for r in run["records"])
        assert s["ttft"]["min_ms"] == pytest.approx(ttfts[0], abs=1e-3)
        assert s["ttft"]["max_ms"] == pytest.approx(ttfts[-1], abs=1e-3)
    assert plot.read_bytes()[:8] == PNG_MAGIC and plot.stat().st_size > 10_000


def test_compare_prints_ratios_to_the_first_report_and_plots_all(peer, tmp_path, capsys):
    a = bench(peer, tmp_path, "fast", "peer;itl=0.005;tag=102", "--concurrency", "2")
    b = bench(peer, tmp_path, "slow", "peer;itl=0.02;tag=103", "--concurrency", "2")
    capsys.readouterr()
    plot = tmp_path / "cmp.png"
    assert main(["--compare", str(tmp_path / "fast.json"), str(tmp_path / "slow.json"), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    # The table's ratio is the second report's figure over the first's (whatever the machine made of the
    # peer's 4x slower tokens).
    ratio = b["runs"][0]["summary"]["output_tokens_per_s"] / a["runs"][0]["summary"]["output_tokens_per_s"]
    slow_row = next(line for line in table.splitlines() if line.startswith("c=2") and " slow " in line)
    assert f"({ratio:.2f}x)" in slow_row
    fast_row = next(line for line in table.splitlines() if line.startswith("c=2") and " fast " in line)
    assert "(1.00x)" in fast_row
    assert plot.read_bytes()[:8] == PNG_MAGIC


def test_errors_do_not_fail_the_run(peer, tmp_path):
    report = bench(peer, tmp_path, "E", "peer;fail429=2;tag=104", "--concurrency", "1", "--warmup", "0")
    s = report["runs"][0]["summary"]
    assert s["errors"] == {"http_429": 3} and s["num_ok"] == 3


def test_refuses_a_remote_url_without_connecting(capsys):
    t0 = time.perf_counter()
    assert main(["--url", "http://192.0.2.1:8000/v1", "--model", "m", "--no-progress"]) == 1
    # A connection attempt to this unroutable address would hang for minutes (the kernel's SYN retries).
    assert time.perf_counter() - t0 < 30
    assert "--allow-remote" in capsys.readouterr().err


def test_unreachable_server_is_one_clear_error(capsys):
    import socket

    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--url", f"http://127.0.0.1:{port}/v1", "--no-progress"]) == 1
    assert "cannot use the target" in capsys.readouterr().err


def test_python_dash_m_bench(peer, tmp_path):
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--url", peer.url, "--model", "peer;tag=105",
                           "--num-requests", "2", "--output-tokens", "3", "--warmup", "0", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert load_report(out)["runs"][0]["summary"]["num_ok"] == 2


def test_client_processes_split_the_users_and_merge_the_records_on_one_clock(peer, tmp_path):
    """``--client-processes 2``: two client processes of 2 users each send the 6 requests (indexes split by
    parity) and one report holds all 6 records, started after the run began and ended within its duration."""
    report = bench(peer, tmp_path, "split", "peer;ttft=0.05;itl=0.01", "--concurrency", "4",
                   "--client-processes", "2")
    run = report["runs"][0]
    s = run["summary"]
    assert s["num_ok"] == 6 and s["num_output_tokens"] == 48
    assert sorted(r["index"] for r in run["records"]) == list(range(6))
    assert report["settings"]["client_processes"] == 2
    starts = [r["start_ms"] for r in run["records"]]
    assert min(starts) >= 0 and all(r["start_ms"] + r["e2e_ms"] <= s["duration_s"] * 1e3 + 1 for r in run["records"])
