"""POST /v1/chat/completions: validate, template + tokenize in a thread, then stream or collect."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server import protocol
from server.protocol import ChatCompletionRequest
from server.routes.common import (
    chat_prompt_ids,
    checked_params,
    engine_for,
    remaining_context,
    start_run,
    start_tracking,
)
from server.streaming import collect, stream_chat

router = APIRouter(tags=["generation"])


@router.post("/v1/chat/completions", response_model=None, summary="Create a chat completion")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state, engine = engine_for(request, body.model)
    settings = state.settings
    tracker = start_tracking(request, state)
    prompt_ids = await chat_prompt_ids(engine, body.template_messages())
    default_max_tokens = settings.default_max_tokens or remaining_context(engine, len(prompt_ids))
    params = checked_params(engine, prompt_ids,
                            body.to_sampling_params(default_max_tokens, engine.max_model_len), "messages")

    run, ctx = await start_run(request, state, engine, tracker, "chatcmpl", prompt_ids, params,
                               body.include_usage)
    if body.stream:
        return stream_chat(run, ctx, settings.sse_ping_s, settings.shutdown_grace_s)
    result = await collect(run, ctx, request)
    bodies = []
    for choice in (result, *result.more):  # n > 1: one body per choice, merged
        logprobs = protocol.chat_logprobs(choice.logprobs, ctx.token_text) if params.logprobs else None
        bodies.append(protocol.chat_completion(ctx.request_id, ctx.created, ctx.model, choice.text,
                                               choice.finish_reason, ctx.usage(), logprobs))
    return JSONResponse(protocol.with_choices(bodies))
