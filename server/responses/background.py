"""Background responses (``background: true``): queued at once, then run by this process's jobs (server.jobs) with
every event kept in the store, so any process can answer GET, stream it again from ``starting_after``, or cancel it.

A response whose process died while it ran is taken over (server.jobs claims it) and run again from its start: its
kept events are dropped first, so a reader that resumes sees one consistent run. No onnxruntime import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from server.http.prepare import start_run
from server.responses import protocol as wire
from server.responses.events import Event, ResponseAssembler
from server.responses.job import Leases, ResponseJob, prepare_response
from server.responses.store import keep, queued_record
from server.responses.stream import fail_events, response_event_lists
from server.state import ServerState

logger = logging.getLogger(__name__)

# NOTE(server): events are kept in batches this often (a write per token would be a transaction per token), and
# the cancel flag is read this often
FLUSH_S = 0.1
CANCEL_POLL_S = 0.25


class EventWriter:
    """Keeps a background response's events and its state as it goes (status, partial output)."""

    def __init__(self, state: ServerState, assembler: ResponseAssembler) -> None:
        self.store = state.store
        self.assembler = assembler
        self._pending: list[Event] = []
        self._last_s = 0.0

    async def add(self, events: list[Event]) -> None:
        self._pending += events
        if time.monotonic() - self._last_s >= FLUSH_S:
            await self.flush()

    async def flush(self) -> None:
        self._last_s = time.monotonic()
        pending, self._pending = self._pending, []
        await self.store.append_events(self.assembler.skeleton["id"], pending)
        response = self.assembler.response()
        if response["status"] in ("queued", "in_progress"):
            await self.store.update_response(response["id"], status=response["status"], body=response)


async def start_background(state: ServerState, job: ResponseJob, model: str) -> dict[str, Any]:
    """Keep ``job`` queued and run it in this process; returns the queued Response."""
    leases = Leases()
    await leases.engine(state, model)  # held until the run ends (a hub must not unload its model meanwhile)
    assembler = job.assembler(int(time.time()), model)
    queued = assembler.queued()
    request = job.body.model_dump(mode="json", exclude_none=True)
    await state.store.put_response(queued_record(queued, request, job.input_items, state.jobs.owner),
                                   lease_s=state.jobs.lease_s)
    state.jobs.spawn("responses", job.response_id, _run(state, job, assembler, model, leases))
    return queued


async def resume_response(state: ServerState, response_id: str) -> None:
    """Run again a background response whose process died (its claim is this process's now)."""
    record = await state.store.get_response(response_id)
    if record is None or record.status not in ("queued", "in_progress") or record.request is None:
        return
    body = wire.ResponsesRequest.model_validate(record.request)
    assembler = ResponseAssembler(record.body, body.tool_names)
    leases = Leases()
    try:
        model, engine = await leases.engine(state, body.model)
        job = await prepare_response(state, engine, body, response_id)
    except Exception as exc:  # noqa: BLE001 - it could be prepared once; now it cannot (a model gone, ...)
        leases.release(state)
        await _end_failed(state, assembler, f"The response could not be run again after a restart: {exc}")
        return
    await state.store.drop_events(response_id)
    assembler = job.assembler(int(record.created_at), model)
    await state.store.update_response(response_id, status="queued", body=assembler.queued())
    await _run(state, job, assembler, model, leases)


async def _end_failed(state: ServerState, assembler: ResponseAssembler, message: str) -> None:
    events = assembler.fail(message)
    await state.store.append_events(assembler.skeleton["id"], events)
    response = assembler.response()
    await state.store.update_response(response["id"], status=response["status"], body=response)


async def _run(state: ServerState, job: ResponseJob, assembler: ResponseAssembler, model: str,
               leases: Leases) -> None:
    """Run the response to its end (completed, incomplete, failed or cancelled), keeping its events."""
    store, response_id = state.store, job.response_id
    writer = EventWriter(state, assembler)
    try:
        _, engine = await leases.engine(state, model)
        tracker = state.metrics.tracker()
        try:
            run, ctx = await start_run(None, state, engine, tracker, "resp", job.prepared.prompt_ids,
                                       job.prepared.params, include_usage=True, request_id=response_id, model=model)
        except Exception as exc:  # noqa: BLE001 - refused by the engine (overloaded, ...): the response fails
            await _end_failed(state, assembler, str(exc))
            return

        async def consume() -> None:
            async def nothing(_: ResponseAssembler) -> None:
                return None

            try:
                async for events in response_event_lists(run, ctx, assembler, job.prepared.delta_source(), nothing):
                    await writer.add(events)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the engine failed mid-way: the response did
                await writer.add(fail_events(assembler, ctx, exc))
            finally:
                await run.close()

        consuming = asyncio.ensure_future(consume())
        cancelled = await _until_done_or_cancelled(state, response_id, consuming)
        if cancelled:
            assembler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer.flush()
        response = assembler.response()
        await keep(store, job.body, response, job.before, job.input_items)
        logger.info("background response %s: %s", response_id, response["status"])
    finally:
        leases.release(state)


async def _until_done_or_cancelled(state: ServerState, response_id: str, consuming: asyncio.Future) -> bool:
    """Wait for ``consuming``; True when POST .../cancel asked for the response to stop (then it is stopped)."""
    try:
        while True:
            done, _ = await asyncio.wait({consuming}, timeout=CANCEL_POLL_S)
            if done:
                consuming.result()
                return False
            record = await state.store.get_response(response_id)
            if record is None or record.cancel_requested:
                consuming.cancel()
                await asyncio.wait({consuming})
                return True
    except asyncio.CancelledError:  # this process stops: the run stops too (another one takes it over)
        consuming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({consuming})
        raise
