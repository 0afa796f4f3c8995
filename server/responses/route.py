"""OpenAI's Responses API over HTTP: create (streamed, collected or in the background), the stored responses (GET,
DELETE, input_items, cancel, a background stream resumed), input_tokens and compact.

The request becomes a chat request (server.responses.protocol); prompt building, the engine run and the streaming
helpers are the chat route's. Responses live in the state store (server.store), shared by every API process and
replica. NOTE(server): fixed paths are declared before ``/v1/responses/{response_id}`` ones, so no id swallows them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from engine.types import InvalidRequestError
from server.errors import ConflictError, ResponseNotFoundError
from server.http.prepare import chat_prompt, engine_for, start_run, start_tracking
from server.openai.base import OpenAIBaseModel
from server.responses import protocol as wire
from server.responses.background import start_background
from server.responses.job import prepare_response
from server.responses.store import history, keep
from server.responses.stream import collect_response, replay_stream, stream_response
from server.responses.tools import validated
from server.state import ServerState, get_state
from server.store import ResponseRecord

router = APIRouter(tags=["responses"])

# NOTE(server): how long POST .../cancel waits for the process that runs the response to stop it
CANCEL_WAIT_S = 10.0
COMPACT_MAX_TOKENS = 1024


class InputTokensRequest(wire.ResponsesRequest):
    """POST /v1/responses/input_tokens: a create request's fields; nothing runs."""


class CompactRequest(OpenAIBaseModel):
    """POST /v1/responses/compact."""

    model: str | None = None
    input: str | list[Any] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None


@router.post("/v1/responses/input_tokens", response_model=None, summary="Count a response's input tokens")
async def count_input_tokens(body: InputTokensRequest, request: Request) -> Response:
    state, engine = await engine_for(request, body.model, body.ttl)
    with wire.as_responses_errors():
        chat = body.to_chat_request(await history(state.store, body))
        _, _, prompt_ids = await chat_prompt(engine, chat.template_messages(), chat.tool_request(),
                                             chat.template_options(), state.settings.tool_call_parser)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt_ids)})


@router.post("/v1/responses/compact", response_model=None, summary="Compact a conversation")
async def compact(body: CompactRequest, request: Request) -> Response:
    """The conversation (input after the previous response's thread) summarized by the model: the user's messages
    are kept as they are, and one compaction item holds the summary, which this server reads back when the item is
    sent as input again."""
    state, engine = await engine_for(request, body.model)
    response_id = wire.new_id("resp")
    items = [] if body.input is None else ([{"role": "user", "content": body.input}]
                                           if isinstance(body.input, str) else list(body.input))
    summarize = validated(wire.ResponsesRequest, {
        "model": body.model, "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "input": [*items, {"role": "user", "content": wire.COMPACTION_REQUEST}], "temperature": 0,
        "max_output_tokens": _summary_tokens(engine), "store": False})
    job = await prepare_response(state, engine, summarize, response_id)
    tracker = start_tracking(request, state)
    with wire.as_responses_errors():
        run, ctx = await start_run(request, state, engine, tracker, "resp", job.prepared.prompt_ids,
                                   job.prepared.params, include_usage=True, request_id=response_id)
    assembler = job.assembler(ctx.created, ctx.model)

    async def nothing(_: Any) -> None:
        return None

    answer = await collect_response(run, ctx, request, assembler, job.prepared.delta_source(), nothing)
    summary = "".join(part.get("text", "") for item in answer["output"] if item["type"] == "message"
                      for part in item["content"])
    kept = [item for item in wire.input_item_objects(wire.parse_items(items))
            if item.get("type") == "message" and item.get("role") == "user"]
    output = [*kept, {"type": "compaction", "id": wire.new_id("cmp"),
                      "encrypted_content": wire.COMPACTION_PREFIX + summary.strip()}]
    return JSONResponse({"id": response_id, "object": "response.compaction", "created_at": ctx.created,
                         "output": output, "usage": answer["usage"]})


def _summary_tokens(engine: Any) -> int:
    """The most tokens a summary may take: COMPACT_MAX_TOKENS, or a quarter of a short context."""
    return max(1, min(COMPACT_MAX_TOKENS, engine.max_model_len // 4))


@router.post("/v1/responses", response_model=None, summary="Create a model response")
async def create_response(body: wire.ResponsesRequest, request: Request) -> Response:
    state, engine = await engine_for(request, body.model, body.ttl)
    settings = state.settings
    response_id = wire.new_id("resp")
    job = await prepare_response(state, engine, body, response_id)
    model = getattr(request.state, "ortserve_model", None) or state.served_model_name
    if body.background:
        queued = await start_background(state, job, model)
        if body.stream:
            return replay_stream(state.store, response_id, -1, settings.sse_ping_s)
        return JSONResponse(queued)
    tracker = start_tracking(request, state)
    with wire.as_responses_errors():
        run, ctx = await start_run(request, state, engine, tracker, "resp", job.prepared.prompt_ids,
                                   job.prepared.params, include_usage=True, request_id=response_id,
                                   accept_s=(settings.sse_ping_s or None) if body.stream else None)
    assembler = job.assembler(ctx.created, ctx.model)

    async def finished(done: Any) -> None:
        await keep(state.store, body, done.response(), job.before, job.input_items)

    deltas = job.prepared.delta_source()
    if body.stream:
        return stream_response(run, ctx, assembler, deltas, finished, settings.sse_ping_s, settings.shutdown_grace_s)
    return JSONResponse(await collect_response(run, ctx, request, assembler, deltas, finished))


async def _stored(state: ServerState, response_id: str) -> ResponseRecord:
    stored = await state.store.get_response(response_id)
    if stored is None:
        raise ResponseNotFoundError(response_id)
    return stored


@router.get("/v1/responses/{response_id}", response_model=None, summary="Get a stored response")
async def get_response(response_id: str, request: Request, stream: bool = False,
                       starting_after: int | None = Query(None, ge=-1)) -> Response:
    """The response as it stands; with ``stream=true``, a background response's events after ``starting_after``
    (all of them without it), then the rest as they come."""
    state = get_state(request)
    stored = await _stored(state, response_id)
    if stream:
        if not stored.background:
            raise InvalidRequestError("only a background response can be streamed again (create it with "
                                      "background=true)", param="stream", code="invalid_value")
        return replay_stream(state.store, response_id, -1 if starting_after is None else starting_after,
                             state.settings.sse_ping_s)
    return JSONResponse(stored.body)


@router.delete("/v1/responses/{response_id}", response_model=None, summary="Delete a stored response")
async def delete_response(response_id: str, request: Request) -> Response:
    if not await get_state(request).store.delete_response(response_id):
        raise ResponseNotFoundError(response_id)
    return JSONResponse(wire.deleted(response_id))


@router.post("/v1/responses/{response_id}/cancel", response_model=None, summary="Cancel a background response")
async def cancel_response(response_id: str, request: Request) -> Response:
    """Stop a background response (whichever process runs it); answers the response once it has stopped."""
    state = get_state(request)
    stored = await _stored(state, response_id)
    if not stored.background:
        raise ConflictError("only a background response can be cancelled", param="response_id",
                            code="invalid_request")
    record = await state.store.request_cancel(response_id)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while record is not None and record.status in ("queued", "in_progress") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        record = await state.store.get_response(response_id)
    if record is None:
        raise ResponseNotFoundError(response_id)
    return JSONResponse(record.body)


@router.get("/v1/responses/{response_id}/input_items", response_model=None,
            summary="List a stored response's input items")
async def list_input_items(response_id: str, request: Request,
                           order: Literal["asc", "desc"] = "desc",
                           limit: int = Query(20, ge=1, le=100),
                           after: str | None = None) -> Response:
    items = (await _stored(get_state(request), response_id)).input_items
    return JSONResponse(wire.input_items_page(items, order, limit, after))
