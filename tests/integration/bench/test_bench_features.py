"""`ortserve bench --scenario multiturn|copy` against real servers on the tiny model, each interleaved with a
peer that has the feature off: the reports hold what the scenarios promise (no timing asserted)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from bench.cli import main
from server.app import create_app
from tests.integration.server.conftest import api_settings, serve_app

pytestmark = pytest.mark.timeout(300)


def test_multiturn_reuses_the_conversation_and_the_peer_does_not(tiny_model: Path, tmp_path: Path, capsys) -> None:
    with serve_app(create_app(api_settings(tiny_model))) as ours, \
            serve_app(create_app(api_settings(tiny_model, prefix_caching=False))) as peer:
        out, plot = tmp_path / "multiturn.json", tmp_path / "multiturn.png"
        assert main(["--scenario", "multiturn", "--url", ours.url, "--peer-url", peer.url, "--peer-label", "off",
                     "--num-requests", "2", "--turns", "3", "--system-tokens", "20", "--user-tokens", "4",
                     "--output-tokens", "6", "--pause", "0", "--out", str(out), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "later turns" in printed and "cold request" in printed and plot.stat().st_size > 0
    report = json.loads(out.read_text())
    replies = report["replies"]
    assert len(replies) == 2 * 3 * 2 and all(r["error"] is None for r in replies)
    for r in replies:
        if r["target"] == "off":
            assert r["num_cached_tokens"] == 0
        elif r["turn"] > 1:  # the conversation so far, up to the previous answer, came from the cache
            previous = next(p for p in replies if (p["target"], p["index"], p["turn"]) == ("ortserve", r["index"],
                                                                                          r["turn"] - 1))
            assert r["num_cached_tokens"] >= previous["num_prompt_tokens"]
    summary = report["summary"]["targets"]
    assert set(summary) == {"ortserve", "off"} and summary["off"]["cold_speed_ratio"]["median"] > 0


def test_copy_compares_decode_speed_and_text_with_the_peer(tiny_model: Path, tmp_path: Path, capsys) -> None:
    with serve_app(create_app(api_settings(tiny_model))) as ours, \
            serve_app(create_app(api_settings(tiny_model, speculative_tokens=0))) as peer:
        out = tmp_path / "copy.json"
        assert main(["--scenario", "copy", "--url", ours.url, "--peer-url", peer.url, "--num-requests", "2",
                     "--output-tokens", "24", "--pause", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "copy ortserve vs peer1" in printed and "free ortserve vs peer1" in printed
    report = json.loads(out.read_text())
    assert {(r["target"], r["kind"]) for r in report["replies"]} == {
        (t, k) for t in ("ortserve", "peer1") for k in ("copy", "free")}
    for kind in ("copy", "free"):
        peer_summary = report["summary"]["targets"]["peer1"][kind]
        assert peer_summary["compared"] == 2
        # NOTE(tests): the bench counts exact equality; the tiny model computes in float32, where drafts on and off
        # part only at a choice closer than ~3e-5 nats (tests/greedy_close.py, TINY_MAX_GAP_NATS), on every CPU alike
        assert peer_summary["same_text"] == 2  # greedy: speculation never changes the text (float model)


def test_distinct_prompts_keep_two_targets_on_one_server_apart(tiny_model: Path, tmp_path: Path) -> None:
    """Two "targets" that are the same server (as two routers over one set of replicas are): with
    --distinct-prompts neither target's first turn finds the other's system prompt in the cache."""
    with serve_app(create_app(api_settings(tiny_model))) as server:
        out = tmp_path / "multiturn.json"
        assert main(["--scenario", "multiturn", "--url", server.url, "--peer-url", server.url, "--peer-label", "same",
                     "--distinct-prompts", "--num-requests", "2", "--turns", "2", "--system-tokens", "40",
                     "--user-tokens", "4", "--output-tokens", "4", "--pause", "0", "--out", str(out)]) == 0
    replies = json.loads(out.read_text())["replies"]
    assert len(replies) == 2 * 2 * 2 and all(r["error"] is None for r in replies)
    first_turns = [r for r in replies if r["turn"] == 1]
    # Only the chat template's opening tokens can match (well under the 40-token system prompt).
    assert all(r["num_cached_tokens"] < 10 for r in first_turns), first_turns
    later = [r for r in replies if r["turn"] == 2]
    assert all(r["num_cached_tokens"] >= 40 for r in later)  # each target's own conversation is still reused


def test_speculative_reports_the_decode_rate_apart_from_the_prompt(default_model: Path, tmp_path: Path, capsys) -> None:
    """The speculative scenario streams each answer: the rate after the first token (what drafts speed up) and the
    time to it come apart from the wall-time rate, for both targets, with the drafts' counts from /metrics. Each
    target gets --warmup unrecorded requests first (2 here), so its first runs do not fall on the first cell.

    NOTE(tests): on a real instruct model (SmolLM2), whose answer is text on every CPU: the tiny model's random tokens
    are mostly bytes of unfinished characters, which the detokenizer holds back, so that on some CPUs (CI's) a whole
    answer came in one chunk and had no time after its first token to measure."""
    with serve_app(create_app(api_settings(default_model))) as ours, \
            serve_app(create_app(api_settings(default_model, speculative_tokens=0))) as peer:
        out = tmp_path / "speculative.json"
        assert main(["--scenario", "speculative", "--url", ours.url, "--peer-url", peer.url, "--peer-label", "off",
                     "--workloads", "chat", "--temperatures", "0", "--rounds", "1", "--num-requests", "1",
                     "--output-tokens", "24", "--warmup", "2", "--no-progress", "--out", str(out)]) == 0
        for server in (ours, peer):  # 2 warm-ups and the one measured request, each finished
            scraped = httpx.get(f"{server.base}/metrics").text
            finished = re.findall(r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', scraped, re.M)
            assert sum(float(v) for v in finished) == 3, scraped[-2000:]
    printed = capsys.readouterr().out
    assert "after the first token off:" in printed
    (cell,) = json.loads(out.read_text())["cells"]
    for label in ("ortserve", "off"):
        t = cell["targets"][label]
        (n,) = t["tokens"]
        assert 2 <= n <= 24  # an instruct model may end its answer before the limit
        (wall,), (decode,), (ttft,) = t["tok_s"], t["decode_tok_s"], t["ttft_ms"]
        assert ttft > 0 and decode > 0 and wall > 0
        # one request: its wall time holds the time to the first token and the n - 1 tokens' time after it
        assert n / wall >= ttft / 1000 + (n - 1) / decode - 0.01
    assert cell["decode_ratios"]["ortserve / off"] > 0 and cell["ratios"]["ortserve / off"] > 0
    assert cell["targets"]["off"]["draft_tokens"] in (None, 0.0)  # drafts off: nothing drafted
    assert cell["greedy_texts_vs_first"]["off"]["of"] == 1
