"""POST /v1/chat/completions: validate, template + tokenize in a thread, then stream or collect."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.openai import protocol
from server.http.large_bodies import ThreadedBodyRoute
from server.openai.protocol import ChatCompletionRequest
from server.http.prepare import THREADED_MESSAGES, engine_for, prepare_chat, start_run, start_tracking
from server.openai.events import collect, stream_chat, tool_finish_reason, usage

router = APIRouter(tags=["generation"], route_class=ThreadedBodyRoute)


@router.post("/v1/chat/completions", response_model=None, summary="Create a chat completion")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state, engine = await engine_for(request, body.model, body.ttl)
    if len(body.messages) > THREADED_MESSAGES:
        await anyio.to_thread.run_sync(body.check_tool_answers)
    else:
        body.check_tool_answers()
    settings = state.settings
    tracker = start_tracking(request, state)
    prepared = await prepare_chat(engine, settings, body)
    params = prepared.params

    # NOTE(server): a streamed answer whose prompt is still being computed after --sse-ping-s starts anyway (its
    # role chunk, then keep-alives), as /v1/messages and /v1/responses do: opencode gives up after 5 minutes
    # without response headers, and an agent's 7-13k-token first prompt takes that long on two CPU cores.
    run, ctx = await start_run(request, state, engine, tracker, "chatcmpl", prepared.prompt_ids, params,
                               body.include_usage,
                               accept_s=(settings.sse_ping_s or None) if body.stream else None)
    readers = None if prepared.plain else prepared.delta_sources()  # one per choice
    if body.stream:
        return stream_chat(run, ctx, settings.sse_ping_s, settings.shutdown_grace_s, readers=readers)
    result = await collect(run, ctx, request)
    bodies = []
    for i, choice in enumerate((result, *result.more)):  # n > 1: one body per choice, merged
        logprobs = protocol.chat_logprobs(choice.logprobs, ctx.token_text) if params.logprobs else None
        if readers is None:
            bodies.append(protocol.chat_completion(ctx.request_id, ctx.created, ctx.model, choice.text,
                                                   choice.finish_reason, usage(ctx), logprobs,
                                                   metrics=ctx.metrics()))
            continue
        readers[i].feed(choice.text, final=True)
        message = readers[i].message()
        bodies.append(protocol.chat_completion(
            ctx.request_id, ctx.created, ctx.model, message["content"],
            tool_finish_reason(choice.finish_reason, readers[i]), usage(ctx), logprobs,
            tool_calls=message["tool_calls"], reasoning=message.get("reasoning_content"), metrics=ctx.metrics()))
    return JSONResponse(protocol.with_choices(bodies))
