"""The bench harness against a real streaming peer (peer.py): its figures match the peer's timing, its
token counts are exact, errors are recorded (not raised), and the run bounds hold."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest

from bench.loadgen import HttpBackend, HttpSettings, RssSampler, run_load
from bench.metrics import Slo, summarize
from bench.scenarios import iter_requests, poisson_offsets_s

pytestmark = pytest.mark.timeout(120)

_tags = itertools.count(1)


def model(**opts: float) -> str:
    """A fresh peer model string (its own request counter) with these behaviours."""
    parts = [f"{k}={v}" for k, v in opts.items()]
    return ";".join(["peer", *parts, f"tag={next(_tags)}"])


def run(peer, name: str, *, n: int, prompt_tokens: int = 12, output_tokens: int = 10, endpoint: str = "chat",
        request_timeout_s: float = 30.0, scenario: str = "fixed", **load):
    async def go():
        backend = HttpBackend(HttpSettings(url=peer.url, model=name, endpoint=endpoint,
                                           request_timeout_s=request_timeout_s))
        try:
            await backend.prepare()
            specs = iter_requests(scenario, n, prompt_tokens, output_tokens, seed=3)
            return await run_load(backend, specs, n, progress=False, **load)
        finally:
            await backend.aclose()

    return asyncio.run(go())


def test_timing_and_token_counts_match_the_peer(peer, peer_stats):
    ttft_s, itl_s, out = 0.10, 0.02, 10
    name = model(ttft=ttft_s, itl=itl_s)
    result = run(peer, name, n=4, concurrency=1, output_tokens=out)
    s = summarize(result.records, result.duration_s)

    assert s["num_ok"] == 4 and s["errors"] == {}
    for r in result.records:
        assert r.num_chunks == out and r.usage_completion_tokens == out and r.finish_reason == "length"
        assert len(r.itl_s) == out - 1
    # The peer sleeps ttft before the first token and itl between tokens; sleeps never end early, and
    # loopback plus scheduling on a busy 2-core machine adds some ms (the upper bounds are loose but far
    # below what a wrong measurement, e.g. a gap taken from the send time, would give).
    assert ttft_s * 1e3 <= s["ttft"]["min_ms"] and s["ttft"]["p50_ms"] <= ttft_s * 1e3 + 50
    assert 0.75 * itl_s * 1e3 <= s["itl"]["p50_ms"] <= itl_s * 1e3 + 15
    assert itl_s * 1e3 <= s["tpot"]["mean_ms"] <= itl_s * 1e3 + 15
    expected_e2e_ms = (ttft_s + (out - 1) * itl_s) * 1e3
    assert expected_e2e_ms <= s["e2e"]["min_ms"] and s["e2e"]["p50_ms"] <= expected_e2e_ms + 80
    # What the server was asked: the prompt's word count is its token count, and the bench asks for
    # exactly `out` tokens with EOS ignored and usage in the stream.
    seen = peer_stats(name)["requests"]
    assert [r.usage_prompt_tokens for r in result.records] == [q["prompt_words"] for q in seen] == [12] * 4
    for q in seen:
        assert q["max_tokens"] == out and q["min_tokens"] == out and q["ignore_eos"] is True
        assert q["stream_options"] == {"include_usage": True} and q["temperature"] == 0.0
    assert s["token_count_check"]["num_mismatched"] == 0


def test_agrees_with_a_simple_client(peer):
    """The harness's TTFT and e2e match a bare httpx SSE reader hitting the same peer.

    Minima are compared: load from other processes only ever adds time, so the fastest of a few requests
    is what both clients measure when undisturbed.
    """
    name = model(ttft=0.06, itl=0.015)
    simple_ttft, simple_e2e = [], []
    with httpx.Client(timeout=30) as client:
        for _ in range(5):
            t0 = time.perf_counter()
            first = None
            body = {"model": name, "max_tokens": 8, "stream": True,
                    "messages": [{"role": "user", "content": "the of and"}]}
            with client.stream("POST", f"{peer.url}/chat/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if first is None and '"content": "w' in line:
                        first = time.perf_counter() - t0
            simple_ttft.append(first)
            simple_e2e.append(time.perf_counter() - t0)
    result = run(peer, name, n=5, concurrency=1, output_tokens=8, prompt_tokens=3)
    s = summarize(result.records, result.duration_s)
    assert abs(s["ttft"]["min_ms"] - min(simple_ttft) * 1e3) < 10
    assert abs(s["e2e"]["min_ms"] - min(simple_e2e) * 1e3) < 10


def test_closed_loop_holds_the_concurrency_and_throughput_follows(peer, peer_stats):
    ttft_s, itl_s, out, users = 0.02, 0.01, 10, 4
    name = model(ttft=ttft_s, itl=itl_s)
    result = run(peer, name, n=12, concurrency=users, output_tokens=out)
    s = summarize(result.records, result.duration_s)
    assert s["num_ok"] == 12
    assert peer_stats(name)["max_in_flight"] == users
    # 4 users back to back, each request lasting ttft + (out-1)*itl: 3 rounds.
    ideal_tok_s = users * out / (ttft_s + (out - 1) * itl_s)
    assert 0.5 * ideal_tok_s <= s["output_tokens_per_s"] <= 1.02 * ideal_tok_s
    assert s["num_output_tokens"] == 12 * out


def test_errors_are_recorded_by_kind_not_raised(peer):
    # Per request number n at the peer: 429 when n%3==0, else 500 when n%5==0, else cut off after 3
    # chunks when n%4==0, else ended without finish_reason when n%7==0. For n = 1..12:
    # 429: 3,6,9,12; 500: 5,10; dropped: 4,8 (cut) and 7 (no finish_reason); ok: 1,2,11.
    name = model(itl=0.005, fail429=3, fail500=5, drop=4, cut=7)
    result = run(peer, name, n=12, concurrency=2)
    s = summarize(result.records, result.duration_s)
    assert s["errors"] == {"http_429": 4, "http_5xx": 2, "dropped_stream": 3}
    assert s["num_ok"] == 3 and s["num_requests"] == 12
    cut = [r for r in result.records if r.error_kind == "dropped_stream" and r.num_chunks == 3]
    assert len(cut) == 2 and all(r.usage_completion_tokens is None for r in cut)
    assert all(r.error for r in result.records if not r.ok)
    # Figures cover the successful requests only.
    assert s["ttft"]["n"] == 3 and s["e2e"]["n"] == 3


def test_error_event_inside_the_stream(peer):
    name = model(errevent=2)
    result = run(peer, name, n=4, concurrency=1, endpoint="completions")
    kinds = [r.error_kind for r in result.records]
    assert kinds.count("stream_error") == 2 and kinds.count(None) == 2


def test_request_timeout(peer):
    name = model(stall=2)  # every 2nd request waits 60 s for its first token
    t0 = time.perf_counter()
    result = run(peer, name, n=4, concurrency=4, request_timeout_s=0.5)
    assert time.perf_counter() - t0 < 5
    assert [r.error_kind for r in result.records].count("timeout") == 2
    assert all(r.e2e_s < 2 for r in result.records)


def test_duration_cap_cuts_the_run(peer):
    name = model(itl=0.1)  # 50 tokens: 5 s per request
    t0 = time.perf_counter()
    result = run(peer, name, n=10, concurrency=2, output_tokens=50, duration_s=1.0)
    assert time.perf_counter() - t0 < 3
    assert result.num_not_sent == 8
    assert [r.error_kind for r in result.records] == ["deadline", "deadline"]
    assert all(r.num_chunks >= 5 for r in result.records)  # ~1 s of 0.1 s tokens each


def test_open_loop_sends_on_schedule(peer, peer_stats):
    """Poisson arrivals go out at their times even while earlier requests are still streaming."""
    rate, n = 40.0, 16
    name = model(ttft=0.05, itl=0.02)  # 0.23 s per request vs 25 ms mean gap: overlap is certain
    result = run(peer, name, n=n, rate_per_s=rate, seed=5, output_tokens=10)
    offsets = poisson_offsets_s(rate, n, seed=5)
    starts = [r.start_s for r in result.records]
    # A closed loop would space starts by a whole request (>= 0.23 s); timers may run late under load.
    assert all(abs(a - b) < 0.1 for a, b in zip(starts, offsets)), list(zip(starts, offsets))
    assert starts[-1] < 0.23 * (n - 1) / 2
    assert all(r.ok for r in result.records)
    assert peer_stats(name)["max_in_flight"] > 1


def test_soak_mixes_lengths_and_samples_server_rss(peer, peer_stats):
    name = model(itl=0.001)
    sampler = RssSampler(peer.pid, interval_s=0.05, baseline_after=5)
    result = run(peer, name, n=40, concurrency=4, scenario="soak", prompt_tokens=32, output_tokens=16,
                 rss_sampler=sampler)
    assert all(r.ok for r in result.records)
    assert len({r.max_tokens for r in result.records}) > 1 and max(r.max_tokens for r in result.records) <= 16
    assert len({r.usage_prompt_tokens for r in result.records}) > 1
    assert sorted(q["max_tokens"] for q in peer_stats(name)["requests"]) == sorted(r.max_tokens for r in result.records)
    rss = result.rss
    with open(f"/proc/{peer.pid}/status") as f:
        vm_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    # A Python web server holds tens of MB; the end sample is close to what the kernel reports now.
    assert 10e6 < rss["rss_end_bytes"] < 2e9 and abs(rss["rss_end_bytes"] - vm_rss) < 0.2 * vm_rss
    assert rss["rss_baseline_bytes"] is not None and rss["samples"][0]["num_done"] == 0
    assert rss["growth_after_baseline_bytes"] == rss["rss_end_bytes"] - rss["rss_baseline_bytes"]


def test_goodput_counts_requests_within_the_slo(peer):
    name = model(ttft=0.05, itl=0.01)
    result = run(peer, name, n=4, concurrency=1, output_tokens=5)
    tight = summarize(result.records, result.duration_s, Slo(ttft_ms=10))  # nobody makes 10 ms
    loose = summarize(result.records, result.duration_s, Slo(ttft_ms=500, tpot_ms=200))
    assert tight["goodput"]["num_met"] == 0
    assert loose["goodput"]["num_met"] == 4 and loose["goodput"]["fraction"] == 1.0
