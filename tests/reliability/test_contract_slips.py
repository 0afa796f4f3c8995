"""Contract details hostile clients found (issue 25), against a real `ortserve serve` process: malformed HTTP
gets the JSON error shape, range checks carry a `code`, and a `tool` message must answer an earlier call."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.server.conftest import ServeProcess, serve_process
from tests.reliability.conftest import PROMPT, assert_openai_error
from tests.reliability.test_slow_clients import read_until_closed, response_of


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ServeProcess]:
    with serve_process(tiny_model, "--served-model-name", "tiny", "--max-batch", "2") as running:
        yield running


def chat(server: ServeProcess, **body) -> httpx.Response:
    return httpx.post(f"{server.base}/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, **body},
                      timeout=60)


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET / HTTP/1.1\r\nBad Header Line\r\n\r\n",
])
def test_malformed_http_gets_a_json_400_and_the_server_goes_on(server: ServeProcess, raw: bytes) -> None:
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(raw)
        status, headers, body = response_of(read_until_closed(sock))
    assert headers.get("content-type") == "application/json" and headers.get("connection") == "close"
    error = assert_openai_error(status, body, expect_status=400)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request"
    assert chat(server, messages=PROMPT).status_code == 200


@pytest.mark.parametrize("field, value", [
    ("temperature", 5.0), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("top_logprobs", 50), ("n", 3),
    ("max_tokens", 0), ("logit_bias", {"-4": 1}), ("logit_bias", {"5": 101}),
])
def test_range_errors_name_the_field_and_carry_a_code(server: ServeProcess, field: str, value) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    r = chat(server, messages=PROMPT, **{field: value}, **extra)
    error = assert_openai_error(r.status_code, r.content, expect_status=400)
    assert error["param"] == field and error["code"] is not None, error
    assert error["code"] == "invalid_value", error


def test_a_tool_message_that_answers_no_call_is_a_400(server: ServeProcess) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answered = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    assert chat(server, messages=answered).status_code == 200
    for messages, index in (
        ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_1", "content": "42"}], 1),
        ([*answered, {"role": "tool", "tool_call_id": "call_2", "content": "7"}], 3),
    ):
        r = chat(server, messages=messages)
        error = assert_openai_error(r.status_code, r.content, expect_status=400)
        assert error["param"] == f"messages[{index}].tool_call_id" and error["code"] == "invalid_value", error
        assert "answers no tool call" in error["message"]
    assert json.loads(chat(server, messages=PROMPT).content)["choices"][0]["finish_reason"] == "length"


def _post_raw(server: ServeProcess, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.base}/v1/chat/completions", content=body, timeout=120,
                      headers={"content-type": "application/json"})


def test_large_bodies_validated_off_the_loop_answer_as_small_ones_do(server: ServeProcess) -> None:
    """Bodies past THREADED_BODY_BYTES are decoded and validated in the threadpool: the answers are the ones
    FastAPI gives a small body (the same field named, the same codes), and a valid one is served."""
    from server.http.large_bodies import THREADED_BODY_BYTES

    many = [{"role": "user", "content": "hi"}] * (THREADED_BODY_BYTES // 20)
    body = json.dumps({"model": "tiny", "max_tokens": 1, "messages": many}).encode()
    assert len(body) > THREADED_BODY_BYTES
    r = _post_raw(server, body)  # tens of thousands of messages: more tokens than the tiny model's context
    error = assert_openai_error(r.status_code, r.content, expect_status=400)
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded", error
    padded = {"model": "tiny", "max_tokens": 1, "messages": PROMPT, "user": "x" * THREADED_BODY_BYTES}
    assert _post_raw(server, json.dumps(padded).encode()).status_code == 200
    for bad, param, code in (({**padded, "temperature": "hot"}, "temperature", "invalid_type"),
                             ({**padded, "messages": [*PROMPT, {"role": "tool", "content": "x"}]},
                              f"messages[{len(PROMPT)}].tool_call_id", "missing_required_parameter")):
        small = {k: v for k, v in bad.items() if k != "user"} if param == "temperature" else None
        r = _post_raw(server, json.dumps(bad).encode())
        error = assert_openai_error(r.status_code, r.content, expect_status=400)
        assert error["param"] == param and error["code"] == code, error
        if small is not None:  # the same answer as the small body's
            assert assert_openai_error(*(lambda s: (s.status_code, s.content))(_post_raw(
                server, json.dumps(small).encode())), expect_status=400) == error
    r = _post_raw(server, b'{"model": "tiny", "messages": [' + b'{"role": "user", "content": "hi"},' * 20_000 + b"]")
    error = assert_openai_error(r.status_code, r.content, expect_status=400)
    assert error["code"] == "invalid_json", error


def test_a_conversation_too_long_by_its_message_count_is_refused_before_validation(server: ServeProcess) -> None:
    """135,000 small messages (issue 25's 4 MB probe) can't fit the context by their count alone, each rendering
    template tokens: the 400 comes from the decoded body, before pydantic validates 135,000 objects (which held the
    interpreter for a second on a loaded machine). A malformed message among them shows the order: the count's
    answer, not validation's."""
    many = [{"role": "user", "content": ""}] * 135_000
    for messages in (many, [*many[:-1], {"role": "user", "content": 5}]):
        body = json.dumps({"model": "tiny", "max_tokens": 1, "messages": messages}, separators=(",", ":")).encode()
        assert len(body) < 4 * 2**20  # under the body limit, as the probe's 4 MB
        r = _post_raw(server, body)
        error = assert_openai_error(r.status_code, r.content, expect_status=400)
        assert error["param"] == "messages" and error["code"] == "context_length_exceeded", error
        assert "at least" in error["message"]
    # a conversation that fits by count is validated as ever (the malformed message named)
    few = [*PROMPT * 40, {"role": "user", "content": 5}]
    r = _post_raw(server, json.dumps({"model": "tiny", "max_tokens": 1, "messages": few,
                                      "user": "x" * 300_000}).encode())
    error = assert_openai_error(r.status_code, r.content, expect_status=400)
    assert error["param"].startswith(f"messages[{len(few) - 1}].content"), error
    assert chat(server, messages=PROMPT).status_code == 200  # and the server goes on
