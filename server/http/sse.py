"""SSE framing, shared by every protocol: `data:` events (OpenAI, with [DONE]), named events (Responses,
Messages), and the EventSourceResponse with its pings and its shutdown grace."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from sse_starlette import EventSourceResponse

from server.http.run import CutAtShutdownError, EngineRun, with_error_event

def dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# NOTE(server): events are framed here, as bytes, exactly as sse-starlette would frame the same text with
# sep="\n" ("data: " + line + "\n\n"): json.dumps escapes CR and LF inside strings, so the JSON is one
# line. sse-starlette passes bytes through as they are, skipping its per-event ServerSentEvent encoding.
DONE = b"data: [DONE]\n\n"
SLOT = "\x00ortserve-slot\x00"  # a string no chunk contains; json.dumps writes its NULs as \u0000


def data_event(obj: dict[str, Any]) -> bytes:
    """One framed SSE event carrying `obj` as compact JSON."""
    return b"data: " + dump(obj).encode("utf-8") + b"\n\n"


class ChunkTemplate:
    """A chunk whose only varying part is one string field, serialized once around that field.

    Built from the protocol's own dict (the field set to SLOT), so render(text) is byte for byte
    data_event() of the same dict with the field set to text, at the cost of one json.dumps of a string.
    """

    def __init__(self, chunk: dict[str, Any]) -> None:
        head, slot, tail = data_event(chunk).partition(dump(SLOT).encode("utf-8"))
        if not slot or dump(SLOT).encode("utf-8") in tail:
            raise ValueError("a chunk template needs exactly one SLOT field")
        self._head, self._tail = head, tail

    def render(self, text: str) -> bytes:
        return self._head + dump(text).encode("utf-8") + self._tail


def named_event(event: dict[str, Any]) -> bytes:
    """A Responses event: `event: <type>` then its JSON on one `data:` line (no [DONE] ends these streams)."""
    return b"event: " + event["type"].encode("ascii") + b"\ndata: " + dump(event).encode("utf-8") + b"\n\n"


# sse-starlette cancels a stream still open this long after the grace period: only one whose client has
# stopped reading, so that its error event and [DONE] cannot be sent (uvicorn's own limit is later still).
_FORCE_CANCEL_AFTER_GRACE_S = 1.0


def event_source(events: AsyncIterator[bytes], run: EngineRun, ping_s: float,
                 shutdown_grace_s: float) -> EventSourceResponse:
    """SSE response: `data: ...` events (framed bytes) separated by blank lines, keep-alive pings as comments.

    On server shutdown (sse-starlette sees uvicorn's exit signal) the stream may finish during
    `shutdown_grace_s`; one still running then is cut (EngineRun.cut): it ends with an OpenAI error event
    (code shutting_down) and `data: [DONE]`, and the chunked body is terminated, so clients read it to the end.
    """
    shutdown = anyio.Event()

    async def cut_when_the_grace_ends() -> None:
        await shutdown.wait()
        await anyio.sleep(shutdown_grace_s)
        await run.cut(CutAtShutdownError(f"The server is shutting down: this stream was ended after the "
                                         f"{shutdown_grace_s:g} s shutdown grace period.", code="shutting_down"))

    return EventSourceResponse(
        events,
        sep="\n",
        ping=ping_s,
        shutdown_event=shutdown,
        shutdown_grace_period=shutdown_grace_s + _FORCE_CANCEL_AFTER_GRACE_S,
        data_sender_callable=cut_when_the_grace_ends,
        headers={"Cache-Control": "no-cache"},
    )


def stream_batches(batches: AsyncIterator[list[dict[str, Any]]], run: EngineRun,
                   failed: Callable[[Exception], list[bytes]], ping_s: float,
                   shutdown_grace_s: float) -> EventSourceResponse:
    """A stream of named events (Responses, Messages) from lists of events, one list per engine output; an
    exception ends it with ``failed(exc)``'s events."""

    async def events() -> AsyncIterator[bytes]:
        async for batch in batches:
            for event in batch:
                yield named_event(event)

    return event_source(with_error_event(events(), run, failed), run, ping_s, shutdown_grace_s)
