"""POST /v1/responses (OpenAI's Responses API) on the chat path, and the stored responses (GET/DELETE).

The request becomes a chat request (server.responses.protocol); prompt building, the engine run and the
streaming helpers are the chat route's. Stored responses live in the app's bounded in-memory ResponseStore.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from engine.types import InvalidRequestError
from server.responses import protocol as wire
from server.errors import ResponseNotFoundError
from server.responses.protocol import ResponsesRequest, as_responses_errors
from server.responses.events import ResponseAssembler
from server.responses.store import make_stored
from server.http.prepare import engine_for, prepare_chat, start_run, start_tracking
from server.state import ServerState, get_state
from server.responses.stream import collect_response, stream_response

router = APIRouter(tags=["responses"])


def _history(state: ServerState, previous_response_id: str | None) -> list[dict[str, Any]]:
    """The chat messages of the conversation `previous_response_id` ends (400 when it is not stored)."""
    if previous_response_id is None:
        return []
    stored = state.responses.get(previous_response_id)
    if stored is None:
        raise InvalidRequestError(
            f"Previous response with id {previous_response_id!r} not found (responses are kept only with "
            f"store=true, in memory, in a bounded store, while this server runs).",
            param="previous_response_id", code="previous_response_not_found")
    return list(stored.conversation)


@router.post("/v1/responses", response_model=None, summary="Create a model response")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state, engine = await engine_for(request, body.model, body.ttl)
    settings = state.settings
    tracker = start_tracking(request, state)
    history = _history(state, body.previous_response_id)
    response_id = wire.new_id("resp")
    with as_responses_errors():
        chat = body.to_chat_request(history)
        prepared = await prepare_chat(engine, settings, chat)
        run, ctx = await start_run(request, state, engine, tracker, "resp", prepared.prompt_ids, prepared.params,
                                   include_usage=True, request_id=response_id,
                                   accept_s=(settings.sse_ping_s or None) if body.stream else None)
    assembler = ResponseAssembler(wire.response_skeleton(response_id, ctx.created, ctx.model, body), body.tool_names)
    input_items = body.input_items()

    def store(finished: ResponseAssembler) -> None:
        if not body.store:
            return
        response = finished.response()
        output_items = wire.parse_items(response["output"], "output")
        conversation = [*history, *wire.chat_messages(input_items, body.tool_names),
                        *wire.chat_messages(output_items, body.tool_names)]
        state.responses.put(response_id, make_stored(response, conversation, wire.input_item_objects(input_items)))

    deltas = prepared.delta_source()
    if body.stream:
        return stream_response(run, ctx, assembler, deltas, store, settings.sse_ping_s, settings.shutdown_grace_s)
    return JSONResponse(await collect_response(run, ctx, request, assembler, deltas, store))


def _stored(request: Request, response_id: str) -> Any:
    stored = get_state(request).responses.get(response_id)
    if stored is None:
        raise ResponseNotFoundError(response_id)
    return stored


@router.get("/v1/responses/{response_id}", response_model=None, summary="Get a stored response")
async def get_response(response_id: str, request: Request) -> Response:
    return JSONResponse(_stored(request, response_id).body)


@router.delete("/v1/responses/{response_id}", response_model=None, summary="Delete a stored response")
async def delete_response(response_id: str, request: Request) -> Response:
    if not get_state(request).responses.delete(response_id):
        raise ResponseNotFoundError(response_id)
    return JSONResponse(wire.deleted(response_id))


@router.get("/v1/responses/{response_id}/input_items", response_model=None,
            summary="List a stored response's input items")
async def list_input_items(response_id: str, request: Request,
                           order: Literal["asc", "desc"] = "desc",
                           limit: int = Query(20, ge=1, le=100),
                           after: str | None = None) -> Response:
    items = _stored(request, response_id).input_items
    return JSONResponse(wire.input_items_page(items, order, limit, after))
