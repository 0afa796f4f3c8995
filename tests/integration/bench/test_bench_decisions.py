"""`ortserve bench --scenario decisions` against `ortserve serve` on the tiny model with all-MiniLM-L6-v2 for rerank:
every part runs, the report holds the within-round ratios, and the questions after the first read the shared input
from the prefix cache. Speed itself is the bench's to report, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import main
from tests.integration.server.conftest import stop_process, wait_healthy

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ortserve(tmp_path_factory: pytest.TempPathFactory):
    """`python -m server serve` on a tiny synthetic model with a 2,048-token context (its byte-level tokenizer spells
    the bench's texts in many tokens) beside all-MiniLM-L6-v2; yields (base url, pid)."""
    import socket

    from engine.builder import SyntheticSpec, build_synthetic, pull_model

    tiny_model = build_synthetic(tmp_path_factory.mktemp("bench-decisions") / "model", SyntheticSpec(max_length=2048))

    minilm = pull_model("all-minilm-l6-v2", progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--model", str(tiny_model), "--embedding-model",
                             str(minilm), "--host", "127.0.0.1", "--port", str(port), "--provider", "cpu",
                             "--intra-op-threads", "1", "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", lambda: proc.poll() is None, 120, poll_s=0.2)
        except RuntimeError as exc:
            raise RuntimeError(f"ortserve did not become ready ({exc}): {proc.stderr.read()[-2000:]}") from None
        yield f"http://127.0.0.1:{port}/v1", proc.pid
    finally:
        stop_process(proc, 30)


def test_decisions_scenario_reports_every_part(ortserve, tmp_path: Path) -> None:
    url, pid = ortserve
    out = tmp_path / "decisions.json"
    assert main(["--scenario", "decisions", "--url", url, "--rounds", "1", "--concurrency", "1,2", "--num-requests",
                 "2", "--input-words", "40", "--server-pid", str(pid), "--no-progress", "--out", str(out),
                 "--plot", str(tmp_path / "decisions.png")]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert report["scenario"] == "decisions" and summary["errors"] == 0
    assert set(summary["questions"]) == {"1", "5", "20"} and summary["questions"]["1"]["ratio_to_1"] == 1.0
    five = summary["questions"]["5"]
    # the input once, then four questions that take it from the cache (its nonce keeps it out of earlier runs)
    assert five["cached_tokens"] >= 4 * 40 and summary["questions"]["1"]["cached_tokens"] < 40
    assert five["cpu_s"] is not None and five["cpu_s"] > 0
    assert set(summary["decisions_per_s"]) == {"1", "2"} and set(summary["rerank"]) == {"8", "32"}
    assert (tmp_path / "decisions.png").stat().st_size > 0
