"""WebSocket mode of the Responses API (``ws://HOST/v1/responses``), as OpenAI documents it: the client sends
``response.create`` messages (a create request's fields; ``stream`` is implicit, ``background`` is refused) and
receives the same events a stream carries, one JSON message each; one response at a time per connection.

The connection keeps its last response's thread, so a turn may continue it with previous_response_id even with
store=false (nothing else is kept in memory; stored responses come from the store). A problem with one message is
an ``error`` event and the connection goes on. No onnxruntime import.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from engine.types import InvalidRequestError
from server.errors import error_for
from server.http.prepare import start_run
from server.responses import protocol as wire
from server.responses.job import Leases, ResponseJob, prepare_response
from server.responses.store import keep
from server.responses.tools import validated
from server.responses.stream import fail_events, response_event_lists
from server.state import ServerState

logger = logging.getLogger(__name__)

router = APIRouter(tags=["responses"])


class _Thread:
    """The connection's last response: its id and the chat messages of its thread (previous_response_id)."""

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.messages: list[dict[str, Any]] = []


def _error_event(exc: BaseException, sequence_number: int = 0) -> dict[str, Any]:
    status, body, _ = error_for(exc)
    error = body["error"]
    return {"type": "error", "sequence_number": sequence_number, "status": status, "code": error.get("code"),
            "message": error["message"], "param": error.get("param"), "error": error}


@router.websocket("/v1/responses")
async def responses_socket(socket: WebSocket) -> None:
    state: ServerState = socket.app.state.ortserve
    await socket.accept()
    thread = _Thread()
    try:
        while True:
            text = await socket.receive_text()
            try:
                await _one_turn(state, socket, text, thread)
            except WebSocketDisconnect:
                raise
            except Exception as exc:  # noqa: BLE001 - one message's problem; the connection goes on
                if error_for(exc)[0] >= 500:
                    logger.exception("websocket turn failed")
                await socket.send_text(json.dumps(_error_event(exc)))
    except WebSocketDisconnect:
        return


async def _one_turn(state: ServerState, socket: WebSocket, text: str, thread: _Thread) -> None:
    try:
        message = json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequestError("each message must be JSON", param=None, code="invalid_json") from None
    if not isinstance(message, dict) or message.get("type") != "response.create":
        kind = message.get("type") if isinstance(message, dict) else None
        raise InvalidRequestError(f"unsupported event type {kind!r}: this server takes 'response.create'",
                                       param="type", code="unsupported_event")
    fields = {k: v for k, v in message.items() if k not in ("type", "stream")}
    if fields.get("background"):
        raise InvalidRequestError("background is not supported over WebSocket (POST /v1/responses takes it)",
                                       param="background", code="unsupported_parameter")
    body = validated(wire.ResponsesRequest, fields)
    leases = Leases()
    try:
        model, engine = await leases.engine(state, body.model)
        response_id = wire.new_id("resp")
        local = body.previous_response_id is not None and body.previous_response_id == thread.response_id
        if local:  # the connection's own last response (stored or not)
            body = body.model_copy(update={"previous_response_id": None})
        job = await prepare_response(state, engine, body, response_id,
                                     before=list(thread.messages) if local else None)
        if local:
            job.body = job.body.model_copy(update={"previous_response_id": thread.response_id})
        await _run(state, socket, job, model, engine, thread)
    finally:
        leases.release(state)


async def _run(state: ServerState, socket: WebSocket, job: ResponseJob, model: str, engine: Any,
               thread: _Thread) -> None:
    tracker = state.metrics.tracker()
    with wire.as_responses_errors():
        run, ctx = await start_run(None, state, engine, tracker, "resp", job.prepared.prompt_ids,
                                   job.prepared.params, include_usage=True, request_id=job.response_id, model=model)
    assembler = job.assembler(ctx.created, ctx.model)

    async def finished(done: Any) -> None:
        response = done.response()
        await keep(state.store, job.body, response, job.before, job.input_items)
        parsed = wire.parse_items(response["output"], "output")
        thread.response_id = response["id"]
        thread.messages = [*job.before, *wire.chat_messages(wire.parse_items(job.input_items), job.body.tool_names),
                           *wire.chat_messages(parsed, job.body.tool_names)]

    try:
        try:
            async for events in response_event_lists(run, ctx, assembler, job.prepared.delta_source(), finished):
                for event in events:
                    await socket.send_text(json.dumps(event, ensure_ascii=False))
        except WebSocketDisconnect:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-way: response.failed ends the turn
            for event in fail_events(assembler, ctx, exc):
                await socket.send_text(json.dumps(event, ensure_ascii=False))
    finally:
        await run.close()  # a client gone mid-turn aborts the request
