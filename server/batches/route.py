"""/v1/batches: create, retrieve, list and cancel. A batch is kept in the state store; this process's jobs (or any
other's, once this one is gone) run it (server.batches.runner). No onnxruntime import.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from server.batches import protocol as wire
from server.batches.runner import run_batch
from server.errors import ConflictError, NotFoundError
from server.files.route import stored_file
from server.responses.protocol import new_id
from server.state import get_state
from server.store import BatchRecord

router = APIRouter(tags=["batches"])


@router.post("/v1/batches", response_model=None, summary="Create a batch")
async def create_batch(body: wire.CreateBatch, request: Request) -> Response:
    state = get_state(request)
    record = await stored_file(state.store, body.input_file_id, "input_file_id")
    if record.purpose != "batch":
        raise wire.unknown_file(body.input_file_id)
    batch_id = new_id("batch")
    batch = wire.new_batch(body, batch_id, time.time())
    await state.store.put_batch(BatchRecord(batch_id, time.time(), "validating", batch, state.jobs.owner),
                                lease_s=state.jobs.lease_s)
    state.jobs.spawn("batches", batch_id, run_batch(state, batch_id))
    return JSONResponse(batch)


@router.get("/v1/batches", response_model=None, summary="List batches")
async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None) -> Response:
    page = await get_state(request).store.list_batches(limit, after)
    data = [record.body for record in page.data]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": page.has_more})


@router.get("/v1/batches/{batch_id}", response_model=None, summary="Retrieve a batch")
async def retrieve_batch(batch_id: str, request: Request) -> Response:
    record = await get_state(request).store.get_batch(batch_id)
    if record is None:
        raise NotFoundError("batch", batch_id, "batch_id")
    return JSONResponse(record.body)


@router.post("/v1/batches/{batch_id}/cancel", response_model=None, summary="Cancel a batch")
async def cancel_batch(batch_id: str, request: Request) -> Response:
    """The batch goes to ``cancelling``: its runner sends no more lines, stops those running, and ends it as
    ``cancelled`` with output and error files of what was done."""
    store = get_state(request).store
    record = await store.get_batch(batch_id)
    if record is None:
        raise NotFoundError("batch", batch_id, "batch_id")
    if record.status in ("cancelling", "cancelled"):
        return JSONResponse(record.body)
    cancelling = wire.moved(record.body, "cancelling")
    if not await store.update_batch(batch_id, cancelling, only_if=("validating", "in_progress")):
        raise ConflictError(f"Cannot cancel a batch with status {record.status!r}.", param="batch_id",
                            code="invalid_request")
    return JSONResponse(cancelling)
