"""ASGI middleware for the API key (Bearer or x-api-key, constant-time compare) and the request body (size limit,
read timeout; memory given back after large ones).

Both answer before any route runs, in the OpenAI error shape (Anthropic's on the Messages routes). No onnxruntime
import.
"""

from __future__ import annotations

import hmac
import json

import anyio
from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.memory import MemoryReclaim
from server.openai.protocol import error_body
from server.errors import shaped_error


async def _send_json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] | None = None,
                     path: str = "") -> None:
    body = shaped_error(status, body, path)
    payload = json.dumps(body).encode("utf-8")
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers + (headers or [])})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class AuthMiddleware:
    """Requires the API key on every path but `open_paths` (when a key is set): `Authorization: Bearer <api_key>`
    (OpenAI's clients) or `x-api-key: <api_key>` (Anthropic's)."""

    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: frozenset[str]) -> None:
        self.app = app
        self._key = api_key.encode("utf-8") if api_key else None
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # NOTE(server): OPTIONS needs the key like any other method, or its 405-versus-404 would tell a client
        # without one which routes exist. CORS preflights (which carry no credentials) never get here: when
        # CORS is on, its middleware runs first and answers them. "/health/" is "/health".
        if (self._key is None or scope["type"] not in ("http", "websocket")
                or (scope["path"].rstrip("/") or "/") in self._open_paths):
            await self.app(scope, receive, send)
            return
        header = api_key = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
            elif name == b"x-api-key":
                api_key = value
        scheme, _, token = header.partition(b" ")
        # NOTE(server): hmac.compare_digest so the comparison time does not leak the key's prefix.
        if (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)) or \
                (api_key and hmac.compare_digest(api_key.strip(), self._key)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # NOTE(server): closing before accepting answers the handshake with 403
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        message = ("Missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')."
                   if not header and not api_key else "Invalid API key.")
        await _send_json(send, 401, error_body(message, "authentication_error", None, "invalid_api_key"),
                         [(b"www-authenticate", b"Bearer")], path=scope["path"])


# Bodies at least this large make the server give memory back shortly after their request (server.http.memory).
_LARGE_BODY_BYTES = 64 << 10


class _BodyTooLarge(HTTPException):
    """Raised from `receive`; FastAPI re-raises HTTPExceptions from body reading, errors.py answers 413."""

    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(413, f"The request body is larger than {max_body_bytes} bytes.")


class _BodyTimedOut(HTTPException):
    """Raised from `receive` when the client pauses too long mid-body; answered 408, then the connection closes."""

    def __init__(self, body_timeout_s: float) -> None:
        super().__init__(408, f"The request body stopped arriving: nothing for {body_timeout_s:g} s.",
                         headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Answers 413 when a body is larger than `max_body_bytes` (by Content-Length or while streaming in), and 408
    when the client pauses longer than `body_timeout_s` while sending it (e.g. a body shorter than its
    Content-Length).

    Also labels every POST body as JSON: the API takes no other body, and `curl -d` sends a form
    content type; bad JSON then gets the same 400 whatever the client claimed.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float = 30.0,
                 upload_paths: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        # POST paths that take multipart uploads (POST /v1/files), with their own bound; their content type stays
        self.upload_paths = dict(upload_paths or {})
        self._reclaim = MemoryReclaim()

    def _too_large(self, limit: int) -> dict:
        return error_body(f"The request body is larger than {limit} bytes.",
                          "invalid_request_error", None, "request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["method"] == "POST" and scope["path"] in self.upload_paths
        limit = self.upload_paths[scope["path"]] if upload else self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await _send_json(send, 413, self._too_large(limit), path=scope["path"])
                    return
        if scope["method"] == "POST" and not upload:
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        received = 0
        body_complete = False

        async def limited_receive() -> Message:
            nonlocal received, body_complete
            if body_complete:  # what comes now is http.disconnect, whenever the client leaves: no deadline
                return await receive()
            with anyio.move_on_after(self.body_timeout_s):
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise _BodyTooLarge(limit)
                body_complete = message["type"] != "http.request" or not message.get("more_body", False)
                return message
            raise _BodyTimedOut(self.body_timeout_s)

        # NOTE(server): `send` goes to the app untouched (no wrapper on every streamed chunk). The limit and
        # the timeout are raised only while the body is read, and every route reads it whole before it
        # answers (FastAPI parses the body before the endpoint runs); starlette's ExceptionMiddleware turns
        # them into the 413 or 408 then. If one reaches here, no response has started: a handled exception
        # after the start surfaces as starlette's RuntimeError instead.
        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await _send_json(send, 413, self._too_large(limit), path=scope["path"])
        except _BodyTimedOut as exc:
            await _send_json(send, 408, error_body(exc.detail, "invalid_request_error", None, "request_timeout"),
                             [(b"connection", b"close")], path=scope["path"])
        finally:
            if received >= _LARGE_BODY_BYTES:
                self._reclaim.soon()
