"""Responses in the state store (server.store): the history a request continues (previous_response_id, or a
conversation's items), and what a finished response leaves behind (its record, the conversation's new items).

No SQL here and no engine import: the store's interface only.
"""

from __future__ import annotations

import json
import time
from typing import Any

from engine.types import InvalidRequestError
from server.errors import NotFoundError
from server.responses import protocol as wire
from server.store import ResponseRecord, Store


def _size(*parts: Any) -> int:
    return sum(len(json.dumps(part, ensure_ascii=False)) for part in parts)


def make_record(response: dict[str, Any], conversation: list[dict[str, Any]], input_items: list[dict[str, Any]],
                *, request: dict[str, Any] | None = None, owner: str | None = None) -> ResponseRecord:
    """The stored form of ``response`` (a Response object) and what a follow-up needs."""
    return ResponseRecord(response["id"], float(response["created_at"]), response["status"], response, conversation,
                          input_items, bool(response.get("background")), request,
                          _size(response, conversation, input_items), owner)


async def history(store: Store, body: wire.ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages before this request's input: the previous response's thread (400 when it is not stored,
    as OpenAI answers), or the conversation's items (404 for an unknown conversation)."""
    if body.previous_response_id is not None:
        stored = await store.get_response(body.previous_response_id)
        if stored is None or stored.status in ("queued", "in_progress"):
            raise InvalidRequestError(
                f"Previous response with id {body.previous_response_id!r} not found"
                f"{' (it is still running)' if stored is not None else ''}.",
                param="previous_response_id", code="previous_response_not_found")
        return list(stored.conversation)
    conversation_id = body.conversation_id
    if conversation_id is not None:
        if await store.get_conversation(conversation_id) is None:
            raise NotFoundError("conversation", conversation_id, "conversation")
        items = await store.all_items(conversation_id)
        return wire.chat_messages(wire.parse_items(items, "conversation"), body.tool_names)
    return []


async def keep(store: Store, body: wire.ResponsesRequest, response: dict[str, Any], before: list[dict[str, Any]],
               input_items: list[dict[str, Any]]) -> None:
    """What a finished response leaves: its record (with store=true) and, with a conversation, the turn's items.

    Args:
        before: the chat messages it continued (``history``).
        input_items: this request's input items as GET .../input_items lists them (each with an id).
    """
    output = response["output"]
    if body.store:
        parsed_in = wire.parse_items(input_items, "input")
        parsed_out = wire.parse_items(output, "output")
        conversation = [*before, *wire.chat_messages(parsed_in, body.tool_names),
                        *wire.chat_messages(parsed_out, body.tool_names)]
        if body.background:  # its record exists (queued), with its events: only what changed
            await store.update_response(response["id"], status=response["status"], body=response,
                                        conversation=conversation)
        else:
            await store.put_response(make_record(response, conversation, input_items))
    if body.conversation_id is not None and response["status"] in ("completed", "incomplete"):
        await store.add_items(body.conversation_id, [*input_items, *output])


def queued_record(response: dict[str, Any], request: dict[str, Any], input_items: list[dict[str, Any]],
                  owner: str) -> ResponseRecord:
    """A background response as it is first kept: queued, with its request (to run again after a crash)."""
    return make_record(response, [], input_items, request=request, owner=owner)


def now_s() -> int:
    return int(time.time())
