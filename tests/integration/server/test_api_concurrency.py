"""Many streams at once, new requests during a stream, disconnects, a full queue."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.app import create_app
from tests.conftest import DecodeGate
from tests.integration.server.conftest import RunningServer, api_settings, fault_loader, serve_app
from tests.pacing import ProcessDecodeGate

HI = [{"role": "user", "content": "Tell me a long story"}]
LONG = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _check_stream(chunks: list, max_tokens: int) -> str:
    """Asserts one well-formed chat stream with include_usage; returns its text."""
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == max_tokens
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_eight_concurrent_streams_complete(api_server: RunningServer) -> None:
    async def one(client: openai.AsyncOpenAI, seed: int) -> tuple[str, str]:
        stream = await client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=120, stream=True, stream_options={"include_usage": True},
            seed=seed, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[0].id, _check_stream(chunks, 120)

    async def main() -> list[tuple[str, str]]:
        async with api_server.async_client() as client:
            return await asyncio.gather(*(one(client, seed) for seed in range(8)))

    before = api_server.metrics()
    results = asyncio.run(main())
    assert len({rid for rid, _ in results}) == 8
    m = api_server.wait_idle(2.0)
    assert m["ortserve_requests_running"] == 0 and m["ortserve_requests_waiting"] == 0
    assert m["ortserve_kv_slots_free"] == 8
    key = 'ortserve_requests_total{status="length"}'
    assert m[key] - before[key] == 8


def test_new_requests_do_not_interrupt_a_running_stream(api_server: RunningServer) -> None:
    async def main() -> tuple[list, Any, list]:
        async with api_server.async_client() as client:
            stream = await client.chat.completions.create(
                model="tiny", messages=HI, max_tokens=1500, stream=True, stream_options={"include_usage": True},
                **LONG)
            chunks, others = [], None
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 3:  # mid-stream: a plain request and another stream arrive
                    others = asyncio.gather(
                        client.chat.completions.create(model="tiny", messages=HI, max_tokens=10, **LONG),
                        client.chat.completions.create(model="tiny", messages=HI, max_tokens=10, stream=True,
                                                       stream_options={"include_usage": True}, **LONG))
            plain, second = await others
            return chunks, plain, [c async for c in second]

    chunks, plain, second = asyncio.run(main())
    _check_stream(chunks, 1500)  # ran to the end: every token, one finish_reason, the usage chunk
    assert plain.usage.completion_tokens == 10 and plain.choices[0].finish_reason == "length"
    _check_stream(second, 10)


def test_disconnect_after_three_chunks_frees_the_request(api_model: Path) -> None:
    gate = DecodeGate()
    with serve_app(create_app(api_settings(api_model), loader=fault_loader(gate))) as running:
        before = running.metrics()
        body = {"model": "tiny", "messages": HI, "max_tokens": 1900, "stream": True, "temperature": 0,
                "ignore_eos": True}
        # The request prefills and decodes twice, then waits at the gate: it is still running when the client
        # leaves, whatever the machine's speed. (Tokens that reach the stream together go out as one chunk, so the
        # client waits for the first chunk and then for the gate to hold the request.)
        gate.shut(after=2)
        try:
            with httpx.Client(timeout=30) as http:
                with http.stream("POST", f"{running.url}/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            assert gate.wait_held()
                            assert running.metrics()["ortserve_requests_running"] == 1  # still generating
                            break  # closing the line iterator closes the connection mid-stream
        finally:
            gate.open()
        m = running.wait_idle(5.0)
        assert m["ortserve_requests_running"] == 0 and m["ortserve_requests_waiting"] == 0
        assert m["ortserve_kv_slots_free"] == 8
        abort = 'ortserve_requests_total{status="abort"}'
        assert m[abort] - before[abort] == 1
        generated = m["ortserve_generation_tokens_total"] - before["ortserve_generation_tokens_total"]
        assert generated < 1900 / 2  # cancelled at once, not run to max_tokens


def test_disconnect_of_a_non_streaming_request_aborts_it(api_model: Path) -> None:
    gate = DecodeGate()
    with serve_app(create_app(api_settings(api_model), loader=fault_loader(gate))) as running:
        before = running.metrics()
        body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 1900, "temperature": 0,
                           "ignore_eos": True}).encode()
        host, port = running.base.removeprefix("http://").split(":")
        gate.shut()  # the request prefills, then waits at its first decode step until the client has left
        try:
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                # the request is running, and no answer can have been sent
                assert gate.wait_held(), "the request never reached a decode step"
            # the client has closed its connection without reading an answer
        finally:
            gate.open()
        m = running.wait_idle(5.0)
        assert m["ortserve_requests_running"] == 0
        abort = 'ortserve_requests_total{status="abort"}'
        assert m[abort] - before[abort] == 1
        generated = m["ortserve_generation_tokens_total"] - before["ortserve_generation_tokens_total"]
        assert generated < 1900 / 2  # cancelled at once, not run to max_tokens


@pytest.mark.parametrize("engine_process", [False, True], ids=["in_process", "engine_process"])
def test_full_queue_is_429_with_retry_after(api_model: Path, engine_process: bool) -> None:
    gate = ProcessDecodeGate() if engine_process else DecodeGate()
    settings = api_settings(api_model, max_batch=1, max_queue=0, engine_process=engine_process)
    with serve_app(create_app(settings, loader=fault_loader(gate))) as running:
        client = running.client()
        body = {"model": "tiny", "messages": HI, "max_tokens": 1900, "stream": True, "temperature": 0,
                "ignore_eos": True}
        gate.shut()  # the stream prefills, then holds the only slot until the gate opens, on any machine
        try:
            with httpx.stream("POST", f"{running.url}/chat/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()  # NOTE: kept referenced; closing it would close the connection
                while not next(lines).startswith("data: "):  # the first chunk: the only slot is taken
                    pass
                for stream in (False, True):
                    with pytest.raises(openai.RateLimitError) as info:
                        client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, stream=stream)
                    assert int(info.value.response.headers["retry-after"]) >= 1
                    assert info.value.body["code"] == "server_overloaded"
        finally:
            gate.open()
        m = running.wait_idle(5.0)
        assert m['ortserve_requests_total{status="rejected"}'] == 2
        # The slot is free again.
        assert client.chat.completions.create(model="tiny", messages=HI, max_tokens=2).usage.completion_tokens == 2


# NOTE: engine faults (an error event mid-stream, other streams unharmed, recovery) are tested through
# the engine's own fault hook in tests/reliability/test_server_faults.py.


def test_two_apps_in_one_process_keep_separate_metrics(api_server: RunningServer, api_model: Path) -> None:
    with serve_app(create_app(api_settings(api_model), engine=api_server.engine)) as other:
        other.client().chat.completions.create(model="tiny", messages=HI, max_tokens=3)
        m = other.metrics()
        assert m['ortserve_requests_total{status="length"}'] == 1  # only its own request
        assert m["ortserve_generation_tokens_total"] == 3
    # The shared engine was not shut down by the second app.
    assert api_server.client().chat.completions.create(model="tiny", messages=HI, max_tokens=2).usage
