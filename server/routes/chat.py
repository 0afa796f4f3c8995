"""POST /v1/chat/completions: validate, template + tokenize in a thread, then stream or collect."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server import protocol
from server.protocol import ChatCompletionRequest
from server.routes.common import (
    chat_prompt,
    checked_params,
    engine_for,
    remaining_context,
    start_run,
    start_tracking,
)
from server.streaming import collect, stream_chat, tool_finish_reason
from server.tools.parsers import make_parser
from server.tools.stream import ToolCallStream

router = APIRouter(tags=["generation"])


@router.post("/v1/chat/completions", response_model=None, summary="Create a chat completion")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state, engine = engine_for(request, body.model)
    settings = state.settings
    tracker = start_tracking(request, state)
    plan, prompt_ids = await chat_prompt(engine, body.template_messages(), body.tool_request())
    default_max_tokens = settings.default_max_tokens or remaining_context(engine, len(prompt_ids))
    params = body.to_sampling_params(default_max_tokens, engine.max_model_len)
    if plan.structured is not None or plan.preserved_tokens:
        params = dataclasses.replace(params, structured=plan.structured or params.structured,
                                     preserved_tokens=plan.preserved_tokens)
    params = checked_params(engine, prompt_ids, params, "messages")

    run, ctx = await start_run(request, state, engine, tracker, "chatcmpl", prompt_ids, params,
                               body.include_usage)
    calls = ToolCallStream(make_parser(plan.parser), plan.max_calls) if plan.parser else None
    if body.stream:
        return stream_chat(run, ctx, settings.sse_ping_s, settings.shutdown_grace_s, tool_calls=calls)
    result = await collect(run, ctx, request)
    logprobs = protocol.chat_logprobs(result.logprobs, ctx.token_text) if params.logprobs else None
    if calls is None:
        return JSONResponse(protocol.chat_completion(ctx.request_id, ctx.created, ctx.model, result.text,
                                                     result.finish_reason, ctx.usage(), logprobs))
    calls.feed(result.text, final=True)
    message = calls.message()
    return JSONResponse(protocol.chat_completion(
        ctx.request_id, ctx.created, ctx.model, message["content"],
        tool_finish_reason(result.finish_reason, calls), ctx.usage(), logprobs, tool_calls=message["tool_calls"]))
