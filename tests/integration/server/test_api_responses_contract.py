"""POST /v1/responses keeps the server's contract: metrics, a client that leaves aborts its request (streamed
or not), every error in the OpenAI shape. On the synthetic model (its text is never looked at)."""

from __future__ import annotations

import contextlib
import json
import socket
import sqlite3
from pathlib import Path

import httpx

from server.app import create_app
from tests.conftest import DecodeGate
from tests.integration.server.conftest import RunningServer, api_settings, fault_loader, serve_app

LONG = {"model": "tiny", "input": "Tell me a long story", "temperature": 0, "ignore_eos": True}


def test_metrics_count_responses_by_outcome(api_server: RunningServer) -> None:
    before = api_server.metrics()
    r = api_server.client().responses.create(model="tiny", input="hi", max_output_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.usage.output_tokens == 5
    bad = httpx.post(f"{api_server.url}/responses", json={"input": "hi", "tools": [{"type": "web_search"}],
                                                          "tool_choice": {"type": "web_search"}})
    assert bad.status_code == 400
    m = api_server.wait_idle(1.0)
    for status, added in (("length", 1), ("rejected", 1)):
        key = f'ortserve_requests_total{{status="{status}"}}'
        assert m[key] - before[key] == added, key
    assert m["ortserve_generation_tokens_total"] - before["ortserve_generation_tokens_total"] == 5


def test_a_client_leaving_a_stream_aborts_its_request(api_model: Path) -> None:
    gate = DecodeGate()
    with serve_app(create_app(api_settings(api_model), loader=fault_loader(gate))) as running:
        before = running.metrics()
        body = {**LONG, "max_output_tokens": 1900, "stream": True}
        # Three tokens (a prefill and two decodes), then the request waits at the gate: it is still running when
        # the client leaves, whatever the machine's speed. (Tokens that reach the stream together go out as one
        # delta, so the client waits for the first delta and then for the gate to hold the request.)
        gate.shut(after=2)
        try:
            with httpx.Client(timeout=30) as http:
                with http.stream("POST", f"{running.url}/responses", json=body) as r:
                    for line in r.iter_lines():
                        if line == "event: response.output_text.delta":
                            assert gate.wait_held()
                            assert running.metrics()["ortserve_requests_running"] == 1  # still generating
                            break  # closing the line iterator closes the connection mid-stream
        finally:
            gate.open()
        m = running.wait_idle(5.0)
        assert m["ortserve_requests_running"] == 0 and m["ortserve_kv_slots_free"] == 8
        abort = 'ortserve_requests_total{status="abort"}'
        assert m[abort] - before[abort] == 1
        assert m["ortserve_generation_tokens_total"] - before["ortserve_generation_tokens_total"] < 1900 / 2


def test_a_client_leaving_a_non_streamed_request_aborts_it(api_model: Path, tmp_path: Path) -> None:
    gate = DecodeGate()
    state_db = tmp_path / "state.db"
    with serve_app(create_app(api_settings(api_model, state_url=str(state_db)), loader=fault_loader(gate))) as running:
        before = running.metrics()
        body = json.dumps({**LONG, "max_output_tokens": 1900}).encode()
        host, port = running.base.removeprefix("http://").split(":")
        gate.shut()  # the request prefills, then waits at its first decode step until the client has left
        try:
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                assert gate.wait_held(), "the request never reached a decode step"
        finally:
            gate.open()
        m = running.wait_idle(5.0)
        assert m["ortserve_requests_running"] == 0
        abort = 'ortserve_requests_total{status="abort"}'
        assert m[abort] - before[abort] == 1
        assert m["ortserve_generation_tokens_total"] - before["ortserve_generation_tokens_total"] < 1900 / 2
        with contextlib.closing(sqlite3.connect(state_db)) as db:  # an aborted response is not stored
            assert db.execute("SELECT count(*) FROM responses").fetchone()[0] == 0


def test_websocket_mode_needs_the_api_key(api_model: Path, tmp_path: Path) -> None:
    import websockets.sync.client as ws_client
    from websockets.exceptions import InvalidStatus

    settings = api_settings(api_model, api_key="sekrit", state_url=str(tmp_path / "state.db"))
    with serve_app(create_app(settings)) as running:
        url = running.base.replace("http://", "ws://") + "/v1/responses"
        try:
            ws_client.connect(url, open_timeout=10).close()
        except InvalidStatus as exc:
            assert exc.response.status_code == 403
        else:
            raise AssertionError("a WebSocket without the key was accepted")
        client = running.client(api_key="sekrit")
        with client.responses.connect() as connection:
            connection.response.create(model="tiny", input="hi", max_output_tokens=2)
            assert next(iter(connection)).type == "response.created"
