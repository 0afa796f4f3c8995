"""POST /v1/completions: one prompt (text or token ids), streamed or collected."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.openai import protocol
from server.http.large_bodies import ThreadedBodyRoute
from server.openai.protocol import CompletionRequest
from server.http.prepare import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    checked_params,
    completion_prompt_ids,
    engine_for,
    sampling_defaults,
    start_run,
    start_tracking,
)
from server.openai.events import collect, stream_completion, usage

router = APIRouter(tags=["generation"], route_class=ThreadedBodyRoute)


@router.post("/v1/completions", response_model=None, summary="Create a completion")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state, engine = await engine_for(request, body.model, body.ttl)
    settings = state.settings
    tracker = start_tracking(request, state)
    prompt_ids = await completion_prompt_ids(engine, body.prompt_text_or_ids())
    body = sampling_defaults(body, settings, engine)
    default_max_tokens = settings.default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    params = checked_params(engine, prompt_ids,
                            body.to_sampling_params(default_max_tokens, engine.max_model_len), "prompt")

    run, ctx = await start_run(request, state, engine, tracker, "cmpl", prompt_ids, params,
                               body.include_usage)
    if body.stream:
        return stream_completion(run, ctx, settings.sse_ping_s, settings.shutdown_grace_s)
    result = await collect(run, ctx, request)
    bodies = []
    for choice in (result, *result.more):  # n > 1: one body per choice, merged
        logprobs = protocol.completion_logprobs(choice.logprobs, ctx.token_text, 0) if params.logprobs else None
        bodies.append(protocol.completion_chunk(ctx.request_id, ctx.created, ctx.model, choice.text,
                                                finish_reason=choice.finish_reason, logprobs=logprobs,
                                                usage_dict=usage(ctx), metrics=ctx.metrics()))
    return JSONResponse(protocol.with_choices(bodies))
