"""One Responses request made ready to run, however it arrived (POST, a WebSocket turn, a background response taken
over after a crash): its history from the store, its chat prompt, its input items, and the model that runs it.

No onnxruntime import; the store through its interface only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from server.engine_client import EngineClient
from server.http.prepare import PreparedChat, prepare_chat
from server.responses import protocol as wire
from server.responses.events import ResponseAssembler
from server.responses.store import history
from server.state import ServerState


@dataclass
class ResponseJob:
    """What one response needs to run and to be kept.

    Attributes:
        before: the chat messages it continues (previous_response_id's thread or the conversation's items).
        input_items: its input items as GET .../input_items lists them (each with an id).
    """

    body: wire.ResponsesRequest
    response_id: str
    before: list[dict[str, Any]]
    prepared: PreparedChat
    input_items: list[dict[str, Any]]

    def assembler(self, created_at: int, model: str) -> ResponseAssembler:
        return ResponseAssembler(wire.response_skeleton(self.response_id, created_at, model, self.body),
                                 self.body.tool_names)


async def prepare_response(state: ServerState, engine: EngineClient, body: wire.ResponsesRequest,
                           response_id: str, before: list[dict[str, Any]] | None = None) -> ResponseJob:
    """History, chat prompt and input items of ``body``; its errors name the Responses fields (400/404).
    ``before``: the history, when the caller has it (a WebSocket connection's last response)."""
    with wire.as_responses_errors():
        if before is None:
            before = await history(state.store, body)
        chat = body.to_chat_request(before)
        prepared = await prepare_chat(engine, state.settings, chat)
    return ResponseJob(body, response_id, before, prepared, wire.input_item_objects(body.input_items()))


@dataclass
class Leases:
    """Model leases held by work that no HTTP request carries (a background response): ``state`` stands in for a
    request's (server.hub.registry.ModelRegistry.acquire keeps the leases there); released when the work ends."""

    state: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(ortserve_leases=[]))

    async def engine(self, state: ServerState, model: str | None) -> tuple[str, EngineClient]:
        entry = await state.acquire(self, model, "chat")  # type: ignore[arg-type]
        return entry.name, entry.engine if entry.engine is not None else state.require_engine()

    def release(self, state: ServerState) -> None:
        for entry in self.state.ortserve_leases:
            state.registry.release(entry)
        self.state.ortserve_leases.clear()
