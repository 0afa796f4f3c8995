"""Disconnect storm: 500 streams, 32 at a time, 40% of them dropped by the client at a random point.

Afterwards nothing runs or waits, every KV slot is free (/metrics and engine.stats()), the counters add
up, and a greedy request gives exactly what a fresh server gives.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import httpx

from tests.integration.server.conftest import RunningServer
from tests.reliability.conftest import AbusedServer, assert_answers_as_fresh, wait_idle_engine

NUM_REQUESTS = 500
CONCURRENCY = 32
DISCONNECT_SHARE = 0.4


@dataclass(frozen=True)
class Plan:
    index: int
    max_tokens: int
    temperature: float
    cut_after: int | None  # None: read to the end; 0: leave before the first event; k: after k events
    # (a stream with fewer events than that ends before the client leaves: it counts as complete)
    cut_before_response: bool  # leave while the request is still being answered (no headers yet)


def make_plans(seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for index in range(NUM_REQUESTS):
        max_tokens = rng.randint(2, 200)
        cut = rng.random() < DISCONNECT_SHARE
        plans.append(Plan(index, max_tokens, rng.choice([0.0, 0.7, 1.3]),
                          rng.randint(0, max_tokens // 4) if cut else None, cut and rng.random() < 0.15))
    return plans


async def run_one(http: httpx.AsyncClient, url: str, plan: Plan) -> list[str] | None:
    """The data events of a stream read to the end, or None when this client left early."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"story number {plan.index}"}],
            "max_tokens": plan.max_tokens, "temperature": plan.temperature, "seed": plan.index,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if plan.cut_before_response:
        task = asyncio.ensure_future(http.post(url, json=body))
        await asyncio.sleep(random.Random(plan.index).uniform(0.0, 0.01))
        task.cancel()  # closes the connection, whatever the server was doing
        try:
            await task
        except asyncio.CancelledError:
            pass
        return None
    events: list[str] = []
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        if plan.cut_after == 0:
            return None  # the response started; the client leaves before reading any event
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if plan.cut_after is not None and len(events) >= plan.cut_after:
                    return None  # leaving the block closes the connection mid-stream
    return events


def check_complete(events: list[str], plan: Plan) -> None:
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert "error" not in chunks[-1], chunks[-1]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == plan.max_tokens


def test_disconnect_storm_leaves_nothing_behind(rel_server: AbusedServer, fresh_server: RunningServer) -> None:
    plans = make_plans(seed=20261130)
    url = f"{rel_server.url}/chat/completions"
    before = rel_server.metrics()

    async def main() -> list[list[str] | None | BaseException]:
        sem = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            async def bounded(plan: Plan) -> list[str] | None:
                async with sem:
                    return await run_one(http, url, plan)

            return await asyncio.gather(*(bounded(p) for p in plans), return_exceptions=True)

    results = asyncio.run(main())
    failures = [(p, r) for p, r in zip(plans, results) if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    completed = 0
    for plan, events in zip(plans, results):
        if events is not None:
            check_complete(events, plan)
            completed += 1
    num_cut = NUM_REQUESTS - completed  # the clients that really left early
    assert all(events is not None for p, events in zip(plans, results) if p.cut_after is None)
    num_planned = sum(p.cut_after is not None for p in plans)
    assert 0.25 * NUM_REQUESTS < num_cut <= num_planned < 0.5 * NUM_REQUESTS, (num_cut, num_planned)

    # Nothing left behind: the engine's own view and /metrics.
    stats = wait_idle_engine(rel_server.engine)
    assert (stats.num_running, stats.num_waiting, stats.num_slots_free) == (0, 0, stats.num_slots_total)
    m = rel_server.wait_idle(2.0)
    assert m["ortserve_requests_running"] == 0 and m["ortserve_requests_waiting"] == 0
    assert m["ortserve_kv_slots_free"] == stats.num_slots_total
    delta = {s: m[f'ortserve_requests_total{{status="{s}"}}'] - before[f'ortserve_requests_total{{status="{s}"}}']
             for s in ("length", "abort", "error", "rejected", "stop")}
    # Every request was counted at most once; a client that left after the last token may still count as
    # length, and one that left before its request was read is not counted at all.
    assert delta["error"] == delta["rejected"] == delta["stop"] == 0, delta
    num_early = sum(p.cut_before_response for p in plans)
    assert NUM_REQUESTS - num_early <= delta["length"] + delta["abort"] <= NUM_REQUESTS, delta
    assert completed <= delta["length"] and delta["abort"] >= num_cut // 2, (delta, num_cut)
    print(f"disconnect storm: {NUM_REQUESTS} streams, {num_cut} left early, counters {delta}")

    # The next greedy request is what a fresh server answers.
    assert_answers_as_fresh(rel_server.base, fresh_server.base, max_tokens=40)
