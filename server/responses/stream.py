"""The Responses API's events: engine outputs -> response.* events through one ResponseAssembler, streamed or
collected (POST /v1/responses). No onnxruntime import."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
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

async def _response_event_lists(run: EngineRun, ctx: StreamContext, assembler: ResponseAssembler,
                                deltas: DeltaSource, on_finished: Callable[[ResponseAssembler], None],
                                ) -> AsyncIterator[list[Event]]:
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
            on_finished(assembler)
        yield events


def stream_response(run: EngineRun, ctx: StreamContext, assembler: ResponseAssembler, deltas: DeltaSource,
                    on_finished: Callable[[ResponseAssembler], None], ping_s: float,
                    shutdown_grace_s: float) -> EventSourceResponse:
    """A Responses stream: response.created ... response.completed (or .incomplete); an engine failure
    mid-stream ends it with response.failed. A client that goes away aborts the request."""

    def failed(exc: Exception) -> list[bytes]:
        message = error_for(exc)[1]["error"]["message"]  # never a traceback: error_for hides our own bugs
        batch = assembler.fail(message, response_usage(ctx.num_prompt_tokens, ctx.num_generated_tokens,
                                                       ctx.num_cached_tokens))
        on_finished(assembler)
        return [named_event(event) for event in batch]

    batches = _response_event_lists(run, ctx, assembler, deltas, on_finished)
    return stream_batches(batches, run, failed, ping_s, shutdown_grace_s)


async def collect_response(run: EngineRun, ctx: StreamContext, request: Request, assembler: ResponseAssembler,
                           deltas: DeltaSource, on_finished: Callable[[ResponseAssembler], None]) -> dict[str, Any]:
    """Run a non-streamed Responses request to the end through the same assembler; returns the Response."""
    return await drain(run, request, _response_event_lists(run, ctx, assembler, deltas, on_finished),
                       assembler.response)
