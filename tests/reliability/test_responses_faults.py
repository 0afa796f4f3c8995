"""An engine failure in the middle of a Responses stream: response.failed, then the stream ends."""

from __future__ import annotations

import httpx

from tests.integration.server.conftest import RunningServer
from tests.reliability.conftest import AbusedServer, assert_answers_as_fresh, named_events, wait_idle_engine

BODY = {"model": "tiny", "input": "Tell me a story about a robot", "temperature": 0, "ignore_eos": True,
        "max_output_tokens": 200, "stream": True}


def test_a_failed_step_ends_the_stream_with_response_failed(rel_server: AbusedServer,
                                                            fresh_server: RunningServer) -> None:
    # NOTE: armed before the request, by step: its second decode run fails, mid-stream on any machine (armed
    # once some deltas had arrived instead, a fast machine could have finished the stream first).
    rel_server.faults.arm("decode", None, skip=1)
    events = named_events(f"{rel_server.url}/responses", BODY)
    assert [name for name, _ in events][-1] == "response.failed"
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "InjectedFault" in failed["error"]["message"] and "Traceback" not in failed["error"]["message"]
    assert not any(name in ("response.completed", "response.incomplete") for name, _ in events)
    assert len(rel_server.faults.fired) == 1
    # The failed response is stored as the client last saw it.
    stored = httpx.get(f"{rel_server.url}/responses/{failed['id']}", timeout=10).json()
    assert stored["status"] == "failed" and stored["output"] == failed["output"]

    # Recovered: idle, every slot free, and a fresh server's output for the same greedy prompt.
    stats = wait_idle_engine(rel_server.engine)
    assert stats.num_running == 0 and stats.num_slots_free == stats.num_slots_total
    assert_answers_as_fresh(rel_server.base, fresh_server.base)


def test_a_failed_non_streamed_response_is_a_500_in_the_openai_shape(rel_server: AbusedServer) -> None:
    rel_server.faults.arm("decode", None, skip=2)
    r = httpx.post(f"{rel_server.url}/responses", json={**BODY, "stream": False}, timeout=60)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["code"] == "engine_error" and "InjectedFault" in error["message"]
    assert len(rel_server.faults.fired) == 1
