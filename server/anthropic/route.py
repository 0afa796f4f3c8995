"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens, on the chat path.

The request becomes a chat request (server.anthropic.protocol); prompt building, tools, reasoning, the engine
run and streaming are the chat route's. The output's chat deltas become content blocks in one
message_events.MessageAssembler. Errors on these routes take Anthropic's shape (server.errors).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from engine.types import FinishReason

from server.anthropic import protocol as wire
from server.errors import error_for
from server.anthropic.events import Event, MessageAssembler
from server.anthropic.protocol import CountTokensRequest, MessagesRequest, as_messages_errors
from server.reasoning import DeltaSource
from server.http.prepare import chat_prompt, engine_for, prepare_chat, start_run, start_tracking
from server.http.run import EngineRun, StreamContext, check_error, drain
from server.http.sse import named_event, stream_batches

router = APIRouter(tags=["messages"])


def _usage(ctx: StreamContext) -> dict[str, Any]:
    return wire.usage(ctx.num_prompt_tokens, ctx.num_generated_tokens, ctx.num_cached_tokens)


async def _events(run: EngineRun, ctx: StreamContext, assembler: MessageAssembler,
                  deltas: DeltaSource) -> AsyncIterator[list[Event]]:
    """The events of each engine output: message_start with the first (the prompt's usage is known then)."""
    started = False
    if run.pending:  # NOTE(messages): the prompt is still being computed: the message starts now, as Anthropic's does
        yield assembler.start(_usage(ctx))
        started = True
    async for out in run.outputs():
        ctx.account(out)
        events: list[Event] = []
        if not started:  # NOTE(messages): first, even when this output failed (the error event follows it)
            events += assembler.start(_usage(ctx))
            started = True
        if out.finish_reason == FinishReason.ERROR:
            yield events
        check_error(out)
        for delta in deltas.feed(out.text, final=out.finished):
            events += assembler.feed(delta)
        if out.finished:
            reason = str(out.finish_reason) if out.finish_reason is not None else None
            events += assembler.finish(reason, out.stop_string, _usage(ctx), ctx.metrics())
        yield events


def _stream(run: EngineRun, ctx: StreamContext, assembler: MessageAssembler, deltas: DeltaSource,
            ping_s: float, shutdown_grace_s: float) -> EventSourceResponse:
    """message_start ... message_stop; an engine failure mid-stream ends it with an `error` event."""

    def failed(exc: Exception) -> list[bytes]:
        status, body, _ = error_for(exc)  # never a traceback: error_for hides our own bugs
        return [named_event(wire.from_openai_error(status, body, exc))]

    return stream_batches(_events(run, ctx, assembler, deltas), run, failed, ping_s, shutdown_grace_s)


@router.post("/v1/messages", response_model=None, summary="Create a message (Anthropic's Messages API)")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state, engine = await engine_for(request, body.model)
    settings = state.settings
    tracker = start_tracking(request, state)
    message_id = wire.new_id("msg")
    with as_messages_errors():
        prepared = await prepare_chat(engine, settings, body.to_chat())
        run, ctx = await start_run(request, state, engine, tracker, "msg", prepared.prompt_ids, prepared.params,
                                   include_usage=True, request_id=message_id,
                                   accept_s=(settings.sse_ping_s or None) if body.stream else None)
    assembler = MessageAssembler(message_id, ctx.model)
    deltas = prepared.delta_source()
    if body.stream:
        return _stream(run, ctx, assembler, deltas, settings.sse_ping_s, settings.shutdown_grace_s)
    return JSONResponse(await drain(run, request, _events(run, ctx, assembler, deltas), assembler.message))


@router.post("/v1/messages/count_tokens", response_model=None, summary="Count the tokens of a message's prompt")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The prompt /v1/messages would run for the same fields (template, tools, thinking settings), counted."""
    _, engine = await engine_for(request, body.model)
    with as_messages_errors():
        chat = body.to_chat_request(max_completion_tokens=1)
        _, _, prompt_ids = await chat_prompt(engine, chat.template_messages(), chat.tool_request(),
                                             chat.template_options())
    return JSONResponse({"input_tokens": len(prompt_ids)})
