"""An engine failure in the middle of a Messages stream: an Anthropic `error` event ends it; a non-streamed one is a
500 in Anthropic's shape; the server goes on serving."""

from __future__ import annotations

import httpx

from tests.reliability.conftest import AbusedServer, named_events, wait_idle_engine

BODY = {"model": "tiny", "max_tokens": 200, "messages": [{"role": "user", "content": "Tell me a story about a robot"}],
        "temperature": 0, "ignore_eos": True, "stream": True}


def test_a_failed_step_ends_the_stream_with_an_error_event(rel_server: AbusedServer) -> None:
    # NOTE: armed before the request, by step (as in test_responses_faults): its second decode run fails.
    rel_server.faults.arm("decode", None, skip=1)
    events = named_events(f"{rel_server.base}/v1/messages", BODY)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    assert all(name == data["type"] for name, data in events)
    error = events[-1][1]
    assert error["error"]["type"] == "api_error" and "InjectedFault" in error["error"]["message"]
    assert "Traceback" not in error["error"]["message"] and len(rel_server.faults.fired) == 1
    stats = wait_idle_engine(rel_server.engine)
    assert stats.num_running == 0 and stats.num_slots_free == stats.num_slots_total


def test_a_failed_non_streamed_message_is_a_500_in_anthropic_shape(rel_server: AbusedServer) -> None:
    rel_server.faults.arm("decode", None, skip=2)
    r = httpx.post(f"{rel_server.base}/v1/messages", json={**BODY, "stream": False}, timeout=60)
    assert r.status_code == 500
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert "InjectedFault" in body["error"]["message"] and len(rel_server.faults.fired) == 1
    ok = httpx.post(f"{rel_server.base}/v1/messages", json={**BODY, "stream": False, "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["stop_reason"] == "max_tokens"
