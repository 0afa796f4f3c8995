"""Queue time is the wait for a slot: RequestOutput.first_scheduled_s and ortserve_request_queue_time_seconds."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import SamplingParams
from server.app import create_app
from tests.conftest import DecodeGate
from tests.integration.server.conftest import metrics_samples, serve_app
from tests.reliability.conftest import fault_loader, rel_settings

LONG = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)


def test_first_scheduled_s_is_when_the_request_got_its_slot(tiny_model: Path) -> None:
    engine = AsyncEngine.from_model_dir(tiny_model, EngineConfig(max_batch=1, max_queue=2, prefill_chunk=64))

    async def run(rid: str) -> tuple[list, float]:
        outs = [out async for out in engine.generate([5, 6, 7, 8], LONG, rid)]
        return outs, time.monotonic()

    async def main():
        t0 = time.monotonic()
        (a, a_end), (b, _) = await asyncio.gather(run("a"), run("b"))  # b waits for a's only slot
        return t0, a, a_end, b

    try:
        t0, a, a_end, b = asyncio.run(main())
    finally:
        engine.shutdown()
    a_start, b_start = a[0].first_scheduled_s, b[0].first_scheduled_s
    assert a_start is not None and b_start is not None
    assert all(o.first_scheduled_s == a_start for o in a)  # one timestamp per request
    assert t0 <= a_start < t0 + 0.5 * (a_end - t0)
    assert b_start > t0 + 0.5 * (a_end - t0)  # scheduled only once a had finished


def test_the_queue_time_metric_counts_the_wait_not_the_run(tiny_model: Path) -> None:
    gate = DecodeGate()
    with serve_app(create_app(rel_settings(tiny_model, max_batch=1), loader=fault_loader(gate))) as running:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                "temperature": 0, "ignore_eos": True}

        async def main() -> tuple[float, float, float]:
            async with httpx.AsyncClient(base_url=running.base, timeout=60) as http:
                # NOTE: the first request holds the only slot at the gate while the second one queues, for 0.3 s
                # at least: the wait the metric must show is the test's doing, not the machine's speed.
                gate.shut()
                first = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
                while metrics_samples((await http.get("/metrics")).text)["ortserve_requests_running"] != 1:
                    await asyncio.sleep(0.001)  # until the first one holds the only slot
                t_sent = time.perf_counter()
                second = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
                while metrics_samples((await http.get("/metrics")).text)["ortserve_requests_waiting"] != 1:
                    await asyncio.sleep(0.001)  # until the second one waits for it
                await asyncio.sleep(0.3)
                gate.open()
                await first
                t_first_done = time.perf_counter()
                await second
                return t_sent, t_first_done, time.perf_counter()

        try:
            t_sent, t_first_done, t_second_done = asyncio.run(main())
        finally:
            gate.open()
        m = running.metrics()
        assert m["ortserve_request_queue_time_seconds_count"] == 2
        queued = m["ortserve_request_queue_time_seconds_sum"]
        # The second request waited while the first one ran (the first did not wait at all) and no longer.
        assert 0.5 * (t_first_done - t_sent) < queued < t_second_done - t_sent, (queued, t_sent, t_first_done)
        ttft_sum = m["ortserve_time_to_first_token_seconds_sum"]
        assert queued < ttft_sum  # the queue time excludes prefill and templating
