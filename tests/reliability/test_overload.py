"""Overload: far more concurrent requests than slots plus queue, against an `ortserve serve` process.

The excess gets 429 with Retry-After (OpenAI-shaped), every admitted request completes with the fresh server's
greedy text (up to a near-tie: batched there, alone here; tests/greedy_close.py), and the process's RSS stays
bounded over repeated rounds.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close
from tests.integration.server.conftest import RunningServer
from tests.reliability.conftest import assert_openai_error, greedy_run, rss_bytes, serve_process

MAX_BATCH, MAX_QUEUE = 2, 4
NUM_CONCURRENT = 40  # > MAX_BATCH + MAX_QUEUE
MAX_TOKENS = 160
ROUNDS = 5
PROMPTS = [[{"role": "user", "content": f"overload prompt {i}"}] for i in range(4)]


async def one(http: httpx.AsyncClient, url: str, index: int) -> tuple[int, str | GreedyRun, dict[str, str], int]:
    """(status, greedy tokens with their top-k or the error body, headers, prompt index); half the requests stream."""
    messages = PROMPTS[index % len(PROMPTS)]
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": index % 2 == 1, "logprobs": True, "top_logprobs": TOP_K}
    async with http.stream("POST", url, json=body) as r:
        raw = (await r.aread()).decode()
        if r.status_code != 200:
            return r.status_code, raw, dict(r.headers), index
        if not body["stream"]:
            data = json.loads(raw)
            choice = data["choices"][0]
            assert choice["finish_reason"] == "length"
            assert data["usage"]["completion_tokens"] == MAX_TOKENS
            return 200, GreedyRun.from_openai(choice["logprobs"], choice["finish_reason"]), dict(r.headers), index
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0].get("finish_reason")] == ["length"]
        return 200, GreedyRun.from_openai_stream(chunks), dict(r.headers), index


def overload_round(url: str) -> list[tuple[int, str, dict[str, str], int]]:
    async def main() -> list:
        limits = httpx.Limits(max_connections=NUM_CONCURRENT + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, url, i) for i in range(NUM_CONCURRENT)))

    return asyncio.run(main())


def rejected_total(base: str) -> float:
    """sum without (model_name) (ortserve_requests_total{status="rejected"})."""
    values = [s.value for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text)
              for s in family.samples if s.name == "ortserve_requests_total" and s.labels.get("status") == "rejected"]
    assert values, "no ortserve_requests_total{status=rejected}"
    return sum(values)


def test_overload_rejects_the_excess_with_429_and_serves_the_rest(
        tiny_model: Path, fresh_server: RunningServer) -> None:
    expected = [greedy_run(fresh_server.base, p, max_tokens=MAX_TOKENS) for p in PROMPTS]
    # NOTE: the engine is paced (5 ms before each decode step: a request holds its slot 0.8 s at least), so the
    # 40 requests sent at once overlap and the excess is refused however fast the machine runs the model.
    with serve_process(tiny_model, "--served-model-name", "tiny", "--max-batch", str(MAX_BATCH),
                       "--max-queue", str(MAX_QUEUE), decode_delay_s=0.005) as server:
        url = f"{server.base}/v1/chat/completions"
        rss: list[int] = []
        num_429 = 0
        for _ in range(ROUNDS):
            results = overload_round(url)
            rss.append(rss_bytes(server.proc.pid))
            ok = [r for r in results if r[0] == 200]
            rejected = [r for r in results if r[0] != 200]
            assert len(ok) >= MAX_BATCH + MAX_QUEUE and rejected, [r[0] for r in results]
            for status, run, headers, index in ok:
                assert len(run.tokens) == MAX_TOKENS
                assert_greedy_close(expected[index % len(PROMPTS)], run, TINY_MAX_GAP_NATS, f"request {index}")
            for status, body, headers, _ in rejected:
                error = assert_openai_error(status, body, expect_status=429)
                assert error["type"] == "rate_limit_error" and error["code"] == "server_overloaded"
                assert int(headers["retry-after"]) >= 1
            num_429 += len(rejected)
        assert rejected_total(server.base) == num_429
        assert httpx.get(f"{server.base}/health").status_code == 200
        # Bounded memory: after the first (warm-up) round the RSS grows by less than 64 MiB in all.
        growth = rss[-1] - rss[0]
        print(f"overload: {ROUNDS} rounds of {NUM_CONCURRENT}, {num_429} x 429, RSS MiB {[r >> 20 for r in rss]}")
        assert growth < 64 * 2**20, [r >> 20 for r in rss]
        assert server.proc.poll() is None
