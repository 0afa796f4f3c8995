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
    start_tracking,
)
from server.streaming import EngineRun, StreamContext, collect, stream_chat

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

    request_id = protocol.new_id("chatcmpl")
    run = EngineRun(engine, request_id, prompt_ids, params, tracker)
    await run.start(request)  # 429/503 still become HTTP statuses here
    ctx = StreamContext(
        request_id=request_id,
        created=protocol.now_s(),
        model=state.served_model_name,
        include_usage=body.include_usage,
        token_text=lambda token_id: engine.tokenizer.decode([token_id]),
        want_logprobs=params.logprobs,
    )
    if body.stream:
        return stream_chat(run, ctx, settings.sse_ping_s, settings.shutdown_grace_s)
    result = await collect(run, ctx, request)
    logprobs = protocol.chat_logprobs(result.logprobs, ctx.token_text) if params.logprobs else None
    return JSONResponse(protocol.chat_completion(request_id, ctx.created, ctx.model, result.text,
                                                 result.finish_reason, ctx.usage(), logprobs))
