"""Faults seen through the API: a failing engine step (test-only hook) and a corrupt model folder at startup."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from server.app import create_app
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close
from tests.integration.server.conftest import ROOT, RunningServer, free_socket, serve_app
from tests.reliability.conftest import (
    PROMPT, AbusedServer, assert_answers_as_fresh, assert_openai_error, fault_loader, greedy_run, rel_settings,
    wait_idle_engine,
)

LONG = {"model": "tiny", "messages": PROMPT, "temperature": 0, "ignore_eos": True}  # raw JSON bodies
SDK = {"model": "tiny", "messages": PROMPT, "temperature": 0, "extra_body": {"ignore_eos": True}}  # openai client


def _data_lines(lines: list[str]) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_a_failed_step_ends_its_stream_with_an_error_event_and_the_server_recovers(
        rel_server: AbusedServer, fresh_server: RunningServer) -> None:
    async def failing() -> list[str]:
        events: list[str] = []
        async with httpx.AsyncClient(timeout=30) as http:
            body = {**LONG, "max_tokens": 200, "stream": True}
            async with http.stream("POST", f"{rel_server.url}/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        return events

    # NOTE: armed before the request, by step: its second decode run fails, mid-stream on any machine (armed
    # after some chunks had arrived instead, a fast machine could have finished the stream first).
    rel_server.faults.arm("decode", None, skip=1)
    events = asyncio.run(failing())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = assert_openai_error(500, events[-2])
    assert "InjectedFault" in error["message"] and error["code"] == "engine_error"
    chunks = [json.loads(e) for e in events[:-2]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # no normal end was sent
    assert len(rel_server.faults.fired) == 1

    # Recovered: healthy, idle, every slot free, and a fresh server's output for the same greedy prompt.
    assert httpx.get(f"{rel_server.base}/health").status_code == 200
    stats = wait_idle_engine(rel_server.engine)
    assert stats.num_running == 0 and stats.num_slots_free == stats.num_slots_total
    assert_answers_as_fresh(rel_server.base, fresh_server.base)


def test_a_failed_prefill_fails_only_the_new_request_not_the_running_stream(
        rel_server: AbusedServer, fresh_server: RunningServer) -> None:
    async def main() -> tuple[list, httpx.Response, list[str]]:
        async with rel_server.async_client() as client, httpx.AsyncClient(timeout=30) as http:
            stream = await client.chat.completions.create(max_tokens=150, stream=True, logprobs=True,
                                                          top_logprobs=TOP_K, **SDK)
            chunks = [await stream.__anext__(), await stream.__anext__()]  # prefill done, decoding
            rel_server.faults.arm("prefill")
            plain = await http.post(f"{rel_server.url}/chat/completions", json={**LONG, "max_tokens": 5})
            rel_server.faults.arm("prefill")
            async with http.stream("POST", f"{rel_server.url}/chat/completions",
                                   json={**LONG, "max_tokens": 5, "stream": True}) as r:
                streamed = _data_lines([line async for line in r.aiter_lines()])
            chunks += [c async for c in stream]
            return chunks, plain, streamed

    chunks, plain, streamed = asyncio.run(main())
    error = assert_openai_error(plain.status_code, plain.content, expect_status=500)
    assert "InjectedFault" in error["message"]
    assert streamed[-1] == "[DONE]" and "InjectedFault" in assert_openai_error(500, streamed[-2])["message"]
    assert [s.kind for s in rel_server.faults.fired[-2:]] == ["prefill", "prefill"]
    # The running stream saw nothing of it: it ends normally with the fresh server's text.
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    run = GreedyRun.from_openai_stream(chunks)
    assert len(run.tokens) == 150 and text
    # NOTE(tests): it decoded beside the failing requests' runs there, alone here: equal up to a near-tie
    assert_greedy_close(greedy_run(fresh_server.base, max_tokens=150), run, TINY_MAX_GAP_NATS, "the running stream")
    assert wait_idle_engine(rel_server.engine).num_slots_free == 8


def test_the_openai_sdk_sees_the_failure_as_an_api_error(rel_server: AbusedServer) -> None:
    client = rel_server.client()
    before = rel_server.metrics()
    rel_server.faults.arm("decode", None, skip=2)
    with pytest.raises(openai.APIError, match="InjectedFault"):
        for _ in client.chat.completions.create(max_tokens=100, stream=True, **SDK):
            pass
    rel_server.faults.arm("prefill")
    with pytest.raises(openai.InternalServerError, match="InjectedFault"):
        client.chat.completions.create(max_tokens=4, **SDK)
    assert client.chat.completions.create(max_tokens=4, **SDK).usage.completion_tokens == 4
    after = rel_server.wait_idle(2.0)
    for status, count in (("error", 2), ("length", 1), ("abort", 0), ("rejected", 0)):
        key = f'ortserve_requests_total{{status="{status}"}}'
        assert after[key] - before[key] == count, key


# --- a corrupt model folder at startup ----------------------------------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS = {
    "truncated_onnx": lambda d: _truncate(d / "model.onnx"),
    "garbage_onnx": lambda d: (d / "model.onnx").write_bytes(bytes(range(256)) * 64),
    "empty_onnx": lambda d: (d / "model.onnx").write_bytes(b""),
    "truncated_weights": lambda d: _truncate(d / "model.onnx.data"),
    "garbage_genai_config": lambda d: (d / "genai_config.json").write_text("{not json"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_model_folder_exits_non_zero_with_one_clear_message(
        tiny_model: Path, tmp_path: Path, corruption: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    CORRUPTIONS[corruption](model)
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--model", str(model), "--port", str(port)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ORTSERVE_CACHE_DIR": str(tmp_path / "cache")})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-2000:]
    assert "Traceback" not in output, output[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ortserve serve: ") and str(model) in last, last


class _CoreBug(BaseException):
    """Escapes the step's `except Exception`: the engine core thread itself dies."""


def test_a_dead_engine_thread_answers_503_and_health_says_so(tiny_model: Path) -> None:
    num_decodes = itertools.count(1)
    streaming = threading.Event()

    def die(info) -> None:
        # NOTE: the stream's second decode step waits until the client has seen the stream start, then kills the
        # core thread: mid-stream by construction (a fast machine cannot finish the stream first, nor kill the
        # core before the response has started).
        if info.kind == "decode" and next(num_decodes) >= 2:
            streaming.wait(30)
            raise _CoreBug("bug in the core loop")

    with serve_app(create_app(rel_settings(tiny_model), loader=fault_loader(die))) as running:
        assert httpx.get(f"{running.base}/health").status_code == 200

        async def main() -> tuple[list[str], httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as http:
                async with http.stream("POST", f"{running.url}/chat/completions",
                                       json={**LONG, "max_tokens": 200, "stream": True}) as r:
                    events = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 2:
                                streaming.set()
                after = await http.post(f"{running.url}/chat/completions", json={**LONG, "max_tokens": 3})
                return events, after

        events, after = asyncio.run(main())  # no hang: the stream ends, the next request is answered
        assert events[-1] == "[DONE]"
        assert assert_openai_error(503, events[-2])["code"] == "engine_unavailable"
        assert assert_openai_error(after.status_code, after.content, expect_status=503)["type"] == "service_unavailable"
        health = httpx.get(f"{running.base}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert not running.engine.is_running
