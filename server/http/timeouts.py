"""uvicorn's HTTP protocol with a deadline for each request's head, so a client that sends its headers a byte
at a time (or connects and sends nothing) cannot hold a connection forever, and with JSON (OpenAI-shaped)
400s for requests its parser rejects.

uvicorn times out only idle keep-alive connections; the head of a request is read before any ASGI code
runs, so this lives at the protocol level (the body's read timeout is ASGI middleware, in security.py).
Works over either of uvicorn's parsers (httptools, else h11): a request's head is complete once the
protocol has started its request/response cycle. No onnxruntime import.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from server.openai.protocol import error_body


def _json_response(status_line: bytes, message: str, code: str) -> bytes:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status_line, len(body), body))


def _timeout_response(timeout_s: float) -> bytes:
    return _json_response(b"408 Request Timeout", f"The request headers did not arrive within {timeout_s:g} s.",
                          "request_timeout")


class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """Closes a connection (after a 408) whose next request head is not complete `header_timeout_s` after the
    connection opened or that request's first byte arrived. Build one with `with_header_timeout`."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a client that connects and sends nothing

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        awaiting = self._awaiting_head()
        super().data_received(data)
        if self.cycle is not cycle:  # a request's head is complete: its cycle has started
            self._disarm()
        elif awaiting and self._awaiting_head():  # part of a head (after the keep-alive wait, if any)
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP parser rejects (a malformed request line, header or chunked body) gets the
        OpenAI error shape instead of uvicorn's plain text; the connection then closes, as uvicorn's does."""
        if not self.transport.is_closing():
            self.transport.write(_json_response(b"400 Bad Request", f"Malformed HTTP request: {msg}",
                                                "invalid_http_request"))
            self.transport.close()

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.transport.write(_timeout_response(self.header_timeout_s))
            self.transport.close()


def with_header_timeout(header_timeout_s: float) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn.Config(http=...): heads must arrive within `header_timeout_s`."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
