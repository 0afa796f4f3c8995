"""/v1/conversations: create, retrieve, update and delete a conversation; list, add, retrieve and delete its items.

Items are Responses input items (server.responses.protocol validates them: text content only); a response created
with ``conversation`` reads them first and adds its turn. Everything lives in the state store. No onnxruntime
import.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, model_validator

from engine.types import InvalidRequestError
from server.errors import NotFoundError
from server.openai.base import OpenAIBaseModel
from server.responses import protocol as wire
from server.state import get_state
from server.store import ConversationRecord, Store

router = APIRouter(tags=["conversations"])

MAX_ITEMS_PER_CALL = 20  # OpenAI's bound on the items of one create or add


def _items(raw: list[Any], param: str) -> list[dict[str, Any]]:
    """Validated items, each with an id (as input_items lists them)."""
    if len(raw) > MAX_ITEMS_PER_CALL:
        raise InvalidRequestError(f"{param} holds at most {MAX_ITEMS_PER_CALL} items, got {len(raw)}",
                                  param=param, code="invalid_value")
    return wire.input_item_objects(wire.parse_items(raw, param))


class CreateConversation(OpenAIBaseModel):
    items: list[Any] = Field(default_factory=list, description="Initial items (at most 20).")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs.")

    @model_validator(mode="after")
    def _check(self) -> CreateConversation:
        wire.check_metadata(self.metadata)
        return self


class UpdateConversation(OpenAIBaseModel):
    metadata: dict[str, str] = Field(description="Replaces the conversation's metadata.")

    @model_validator(mode="after")
    def _check(self) -> UpdateConversation:
        wire.check_metadata(self.metadata)
        return self


class AddItems(OpenAIBaseModel):
    items: list[Any] = Field(description="Items to append (at most 20).")


def conversation_object(record: ConversationRecord) -> dict[str, Any]:
    return {"id": record.id, "object": "conversation", "created_at": int(record.created_at),
            "metadata": record.metadata}


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


async def _conversation(store: Store, conversation_id: str) -> ConversationRecord:
    record = await store.get_conversation(conversation_id)
    if record is None:
        raise NotFoundError("conversation", conversation_id, "conversation_id")
    return record


@router.post("/v1/conversations", response_model=None, summary="Create a conversation")
async def create_conversation(body: CreateConversation, request: Request) -> Response:
    items = _items(body.items, "items")
    record = ConversationRecord(wire.new_id("conv"), time.time(), dict(body.metadata or {}))
    await get_state(request).store.create_conversation(record, items)
    return JSONResponse(conversation_object(record))


@router.get("/v1/conversations/{conversation_id}", response_model=None, summary="Retrieve a conversation")
async def get_conversation(conversation_id: str, request: Request) -> Response:
    return JSONResponse(conversation_object(await _conversation(get_state(request).store, conversation_id)))


@router.post("/v1/conversations/{conversation_id}", response_model=None, summary="Update a conversation")
async def update_conversation(conversation_id: str, body: UpdateConversation, request: Request) -> Response:
    store = get_state(request).store
    await _conversation(store, conversation_id)
    record = await store.update_conversation(conversation_id, body.metadata)
    if record is None:
        raise NotFoundError("conversation", conversation_id, "conversation_id")
    return JSONResponse(conversation_object(record))


@router.delete("/v1/conversations/{conversation_id}", response_model=None, summary="Delete a conversation")
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    if not await get_state(request).store.delete_conversation(conversation_id):
        raise NotFoundError("conversation", conversation_id, "conversation_id")
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


@router.get("/v1/conversations/{conversation_id}/items", response_model=None, summary="List a conversation's items")
async def list_items(conversation_id: str, request: Request, order: Literal["asc", "desc"] = "desc",
                     limit: int = Query(20, ge=1, le=100), after: str | None = None) -> Response:
    store = get_state(request).store
    await _conversation(store, conversation_id)
    page = await store.list_items(conversation_id, order, limit, after)
    return JSONResponse(_page(page.data, page.has_more))


@router.post("/v1/conversations/{conversation_id}/items", response_model=None, summary="Add items to a conversation")
async def add_items(conversation_id: str, body: AddItems, request: Request) -> Response:
    items = _items(body.items, "items")
    if not await get_state(request).store.add_items(conversation_id, items):
        raise NotFoundError("conversation", conversation_id, "conversation_id")
    return JSONResponse(_page(items, False))


@router.get("/v1/conversations/{conversation_id}/items/{item_id}", response_model=None,
            summary="Retrieve a conversation's item")
async def get_item(conversation_id: str, item_id: str, request: Request) -> Response:
    store = get_state(request).store
    await _conversation(store, conversation_id)
    item = await store.get_item(conversation_id, item_id)
    if item is None:
        raise NotFoundError("item", item_id, "item_id")
    return JSONResponse(item)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}", response_model=None,
               summary="Delete a conversation's item")
async def delete_item(conversation_id: str, item_id: str, request: Request) -> Response:
    store = get_state(request).store
    record = await _conversation(store, conversation_id)
    if not await store.delete_item(conversation_id, item_id):
        raise NotFoundError("item", item_id, "item_id")
    return JSONResponse(conversation_object(record))
