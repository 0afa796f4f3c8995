"""Slow clients cannot hold connections: headers sent a byte at a time (or never), a body shorter than its
Content-Length. `ortserve serve` itself times them out (--header-timeout-s, --body-timeout-s), no proxy needed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.server.conftest import ServeProcess, serve_process
from tests.reliability.conftest import PROMPT, assert_openai_error

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
GIVE_UP_S = 30.0  # far beyond both timeouts: a connection still open then is held, whatever the machine
CHAT = json.dumps({"model": "tiny", "messages": PROMPT, "max_tokens": 2}).encode()
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ServeProcess]:
    with serve_process(tiny_model, "--served-model-name", "tiny", "--header-timeout-s", str(HEADER_TIMEOUT_S),
                       "--body-timeout-s", str(BODY_TIMEOUT_S)) as running:
        yield running


def connect(server: ServeProcess) -> socket.socket:
    host, port = server.base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=GIVE_UP_S)
    return sock


def read_until_closed(sock: socket.socket, trickle: bytes = b"") -> bytes:
    """Everything the server sends until it closes the connection, sending `trickle` one byte every 0.1 s
    meanwhile; fails if the connection is still open after GIVE_UP_S."""
    sock.settimeout(0.1)
    received = b""
    deadline = time.monotonic() + GIVE_UP_S
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if trickle:
                try:
                    sock.send(trickle[:1])
                except OSError:  # closed under us: what is left to read follows
                    trickle = b""
                    continue
                trickle = trickle[1:]
            continue
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the connection is still open after {GIVE_UP_S} s: {received[:200]!r}")


def response_of(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def assert_timed_out(raw: bytes) -> dict:
    status, headers, body = response_of(raw)
    assert headers.get("connection") == "close", headers
    error = assert_openai_error(status, body, expect_status=408)
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error", error
    return error


def test_headers_a_byte_at_a_time_get_408_and_the_connection_closes(server: ServeProcess) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /v1/chat/comp")
        # 10 bytes a second: the head would take far longer than the timeout to arrive.
        raw = read_until_closed(sock, trickle=b"letions HTTP/1.1\r\nHost: test\r\n" * 20)
    assert "headers did not arrive" in assert_timed_out(raw)["message"]


def test_a_connection_that_sends_nothing_is_closed(server: ServeProcess) -> None:
    with connect(server) as sock:
        assert_timed_out(read_until_closed(sock))


def test_the_head_deadline_applies_to_each_request_of_a_kept_alive_connection(server: ServeProcess) -> None:
    with connect(server) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT))
        first = b""
        while b"\r\n\r\n" not in first or len(response_of(first)[2]) < int(response_of(first)[1]["content-length"]):
            first += sock.recv(65536)
        assert response_of(first)[0] == 200
        sock.sendall(b"GET /v1/mod")  # the next request's head stalls
        assert_timed_out(read_until_closed(sock))


def test_a_body_shorter_than_its_content_length_gets_408(server: ServeProcess) -> None:
    with connect(server) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT[:10]))
        error = assert_timed_out(read_until_closed(sock))
    assert "body stopped arriving" in error["message"]


def test_a_body_sent_in_pieces_with_short_pauses_is_served(server: ServeProcess) -> None:
    """Only a pause longer than --body-timeout-s counts: a body that keeps coming is read however long it takes
    (here pauses of a tenth of the timeout)."""
    def pieces() -> Iterator[bytes]:
        for start in range(0, len(CHAT), 8):
            yield CHAT[start:start + 8]
            time.sleep(BODY_TIMEOUT_S / 10)

    r = httpx.post(f"{server.base}/v1/chat/completions", content=pieces(), timeout=GIVE_UP_S,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert len(CHAT) // 8 * BODY_TIMEOUT_S / 10 > BODY_TIMEOUT_S  # the whole body took longer than the timeout


def test_the_server_keeps_serving(server: ServeProcess) -> None:
    with connect(server) as sock:  # one held connection does not block others
        sock.sendall(b"POST /v1/chat")
        r = httpx.post(f"{server.base}/v1/chat/completions", content=CHAT, timeout=GIVE_UP_S,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 200
    assert httpx.get(f"{server.base}/health", timeout=GIVE_UP_S).status_code == 200
