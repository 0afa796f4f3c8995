"""The Responses API's events: engine outputs -> response.* events through one ResponseAssembler, streamed or
collected (POST /v1/responses); and a background response's stored events streamed again (GET ...?stream=true).
No onnxruntime import."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request

from server.errors import error_for
from server.http.run import EngineRun, StreamContext, check_error, drain
from server.http.sse import named_event, stream_batches
from server.openai import protocol
from server.reasoning import DeltaSource
from server.responses.events import Event, ResponseAssembler
from server.responses.protocol import response_usage
from server.store import Store

OnFinished = Callable[[ResponseAssembler], Awaitable[None]]
# NOTE(server): how often a reader of stored events looks for new ones (the writer keeps them every ~0.1 s)
POLL_S = 0.05


async def response_event_lists(run: EngineRun, ctx: StreamContext, assembler: ResponseAssembler,
                               deltas: DeltaSource, on_finished: OnFinished) -> AsyncIterator[list[Event]]:
    """The events of each engine output; `on_finished` runs (e.g. stores the response) before the last ones."""
    yield assembler.start()
    async for out in run.outputs():
        ctx.account(out)
        check_error(out)
        events: list[Event] = []
        for delta in deltas.feed(out.text, final=out.finished):
            events += assembler.feed(delta)
        if out.finished:
            events += assembler.finish(protocol.finish_reason_str(out.finish_reason),
                                       response_usage(ctx.num_prompt_tokens, ctx.num_generated_tokens,
                                                      ctx.num_cached_tokens), ctx.metrics())
            await on_finished(assembler)
        yield events


def fail_events(assembler: ResponseAssembler, ctx: StreamContext, exc: BaseException) -> list[Event]:
    """response.failed for an engine failure mid-way (never a traceback: error_for hides our own bugs)."""
    message = error_for(exc)[1]["error"]["message"]
    return assembler.fail(message, response_usage(ctx.num_prompt_tokens, ctx.num_generated_tokens,
                                                  ctx.num_cached_tokens))


def stream_response(run: EngineRun, ctx: StreamContext, assembler: ResponseAssembler, deltas: DeltaSource,
                    on_finished: OnFinished, ping_s: float, shutdown_grace_s: float) -> EventSourceResponse:
    """A Responses stream: response.created ... response.completed (or .incomplete); an engine failure
    mid-stream ends it with response.failed. A client that goes away aborts the request."""
    pending: set[asyncio.Task] = set()

    def failed(exc: Exception) -> list[bytes]:
        batch = fail_events(assembler, ctx, exc)
        # NOTE(server): called from the stream's error path, which cannot wait: the failed response is kept by a
        # task of its own (held here until it is done)
        task = asyncio.get_running_loop().create_task(on_finished(assembler))
        pending.add(task)
        task.add_done_callback(pending.discard)
        return [named_event(event) for event in batch]

    batches = response_event_lists(run, ctx, assembler, deltas, on_finished)
    return stream_batches(batches, run, failed, ping_s, shutdown_grace_s)


async def collect_response(run: EngineRun, ctx: StreamContext, request: Request, assembler: ResponseAssembler,
                           deltas: DeltaSource, on_finished: OnFinished) -> dict[str, Any]:
    """Run a non-streamed Responses request to the end through the same assembler; returns the Response."""
    return await drain(run, request, response_event_lists(run, ctx, assembler, deltas, on_finished),
                       assembler.response)


async def stored_events(store: Store, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
    """A background response's events with sequence_number > ``after``, as they are kept, until it ends (any
    process may be running it: the store is all the reader and the writer share)."""
    while True:
        events = await store.events_after(response_id, after)
        for event in events:
            yield event
            after = event["sequence_number"]
        if events:
            continue
        record = await store.get_response(response_id)
        if record is None or record.status not in ("queued", "in_progress"):
            # what was kept between the last read and the end
            for event in await store.events_after(response_id, after):
                yield event
            return
        await asyncio.sleep(POLL_S)


def replay_stream(store: Store, response_id: str, after: int, ping_s: float) -> EventSourceResponse:
    """SSE of ``stored_events`` (GET /v1/responses/{id}?stream=true&starting_after=N, and a background stream)."""

    async def frames() -> AsyncIterator[bytes]:
        async for event in stored_events(store, response_id, after):
            yield named_event(event)

    return EventSourceResponse(frames(), sep="\n", ping=ping_s, headers={"Cache-Control": "no-cache"})
