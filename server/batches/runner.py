"""Running a batch: its input file read into lines (validating), each line sent to its endpoint through the app
itself at engine priority 1 (in_progress), then the output and error files written (finalizing -> completed).

A line is a request like any other: the same route, validation and error shapes, but its engine request yields its
row to interactive requests (engine.scheduler). Its result is recorded once, in the store, in the transaction that
marks it done; a batch taken over after a crash sends only the lines still pending. No onnxruntime import.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from server.batches import protocol as wire
from server.state import ServerState
from server.store import BatchLine, FileRecord, Store

logger = logging.getLogger(__name__)

PRIORITY = 1  # engine.scheduler: after interactive requests (0), and preempted by them
# NOTE(server): how often the runner refreshes the batch's counts and looks for a cancel
CHECK_EVERY_S = 1.0


async def run_batch(state: ServerState, batch_id: str) -> None:
    """Take the batch from wherever it stopped to its end."""
    store = state.store
    record = await store.get_batch(batch_id)
    if record is None:
        return
    batch = record.body
    if batch["status"] == "validating":
        batch = await _validate(state, batch)
    if batch["status"] == "in_progress":
        batch = await _run_lines(state, batch)
    if batch["status"] in ("finalizing", "cancelling"):
        await _finalize(store, batch)


async def _file_lines(store: Store, file_id: str) -> AsyncIterator[bytes]:
    pending = b""
    async for chunk in store.file_content(file_id):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


async def _validate(state: ServerState, batch: dict[str, Any]) -> dict[str, Any]:
    """Read the input file into lines; a line that cannot be sent goes to the error file at once."""
    store, limit = state.store, state.settings.batch_max_lines
    if await store.get_file(batch["input_file_id"]) is None:
        failed = wire.moved(batch, "failed", errors=wire.batch_errors("file_not_found", "The input file is gone."))
        await store.update_batch(batch["id"], failed)
        return failed
    lines: list[BatchLine] = []
    seen: set[str] = set()
    model = None
    async for raw in _file_lines(store, batch["input_file_id"]):
        if not raw.strip():
            continue
        if len(lines) >= limit:
            failed = wire.moved(batch, "failed", errors=wire.batch_errors(
                "too_many_requests", f"The input file has more than {limit} requests (--batch-max-lines)."))
            await store.update_batch(batch["id"], failed)
            return failed
        request, error = wire.parse_line(raw.decode("utf-8", errors="replace"), batch["endpoint"])
        if request is not None and request["custom_id"] in seen:
            request, error = None, wire.error_line(request["custom_id"], "duplicate_custom_id",
                                                   "custom_id must be unique within a batch")
        if request is not None:
            seen.add(request["custom_id"])
            model = model or request["body"].get("model")
        lines.append(BatchLine(len(lines), "pending" if request else "failed", request, error))
    if not lines:
        failed = wire.moved(batch, "failed", errors=wire.batch_errors("empty_file", "The input file has no requests."))
        await store.update_batch(batch["id"], failed)
        return failed
    await store.put_lines(batch["id"], lines)
    counts = await store.line_counts(batch["id"])
    started = wire.moved(batch, "in_progress", request_counts=counts, model=model, usage=wire.no_usage())
    if not await store.update_batch(batch["id"], started, only_if=("validating",)):
        return (await store.get_batch(batch["id"])).body  # cancelled meanwhile
    return started


async def _run_lines(state: ServerState, batch: dict[str, Any]) -> dict[str, Any]:
    """Send the pending lines, ``batch_concurrency`` at a time, until none is left or the batch is cancelled."""
    store, batch_id = state.store, batch["id"]
    concurrency = state.settings.batch_concurrency or state.settings.max_batch
    running: set[asyncio.Task] = set()
    # NOTE(server): the running usage is the lines answered before this run (read back from the store: a batch
    # resumed after a crash) plus each line this run records; _finalize sums the stored lines again, so a line
    # this figure missed (another process's, or a task cancelled at the end) still counts once in the end.
    usage = await _answered_usage(store, batch_id)
    after = -1
    next_check = 0.0
    cancelled = False
    try:
        while True:
            for task in [t for t in running if t.done()]:
                running.discard(task)
                result = task.result()  # a line's own failure is its error line; anything else is a bug to surface
                if result is not None:
                    usage = wire.add_usage(usage, result)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + CHECK_EVERY_S
                current = await store.get_batch(batch_id)
                if current is None or current.status != "in_progress":
                    cancelled = True
                    break
                if time.time() > current.body["expires_at"]:  # past its completion window: no line is sent now
                    await _expire_pending(store, batch_id)
                    break
                batch = {**current.body, "request_counts": await store.line_counts(batch_id), "usage": usage}
                await store.update_batch(batch_id, batch, only_if=("in_progress",))
            if len(running) >= concurrency:
                await asyncio.wait(running, timeout=CHECK_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
                continue
            lines = await store.pending_lines(batch_id, concurrency - len(running), after)
            if not lines:
                if not running:
                    break
                await asyncio.wait(running, timeout=CHECK_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
                continue
            for line in lines:
                running.add(asyncio.ensure_future(_run_line(state, batch, line)))
                after = line.line_no
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
    current = await store.get_batch(batch_id)
    if current is None:
        return batch
    if cancelled or current.status != "in_progress":
        return current.body
    finalizing = wire.moved(current.body, "finalizing", request_counts=await store.line_counts(batch_id))
    await store.update_batch(batch_id, finalizing, only_if=("in_progress",))
    return (await store.get_batch(batch_id)).body


async def _expire_pending(store: Store, batch_id: str) -> None:
    """The lines not sent within the completion window go to the error file (code batch_expired)."""
    while lines := await store.pending_lines(batch_id, 500):
        for line in lines:
            custom_id = (line.request or {}).get("custom_id")
            await store.finish_line(batch_id, line.line_no, "failed", wire.error_line(
                custom_id, "batch_expired", "This request could not be run within the batch's completion window."))


async def _answered_usage(store: Store, batch_id: str) -> dict[str, Any]:
    """The usage of the batch's lines answered so far (as stored)."""
    usage = wire.no_usage()
    async for result in store.line_results(batch_id, "completed"):
        usage = wire.add_usage(usage, result)
    return usage


async def _run_line(state: ServerState, batch: dict[str, Any], line: BatchLine) -> dict[str, Any] | None:
    """One line through the app (its route answers as it would over HTTP); its result, kept once (None: it was
    already recorded)."""
    assert line.request is not None
    request_id = uuid.uuid4().hex
    try:
        status, body = await call_app(state, batch["endpoint"], line.request["body"])
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - our own bug: the line fails, the batch goes on
        logger.exception("batch %s line %d failed", batch["id"], line.line_no)
        status, body = 500, {"error": {"message": f"Internal server error: {type(exc).__name__}",
                                       "type": "internal_error", "param": None, "code": "internal_error"}}
    result = wire.result_line(line.request["custom_id"], status, body, request_id)
    recorded = await state.store.finish_line(batch["id"], line.line_no, "completed" if status < 300 else "failed",
                                             result)
    return result if recorded else None


async def call_app(state: ServerState, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` to ``path`` of the app, in process (every middleware and route as over HTTP), at engine
    priority 1 (``ortserve.priority`` in the ASGI scope: no HTTP client can set it); (status, JSON body)."""
    payload = json.dumps(body).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    key = state.settings.api_key_value()
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "ortserve.priority": PRIORITY}
    sent = False
    done = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await done.wait()  # NOTE(server): the "client" stays until the answer is whole
        return {"type": "http.disconnect"}

    status = 500
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await state.app(scope, receive, send)
    finally:
        done.set()
    text = b"".join(chunks)
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text.decode("utf-8", errors="replace")


async def _finalize(store: Store, batch: dict[str, Any]) -> None:
    """Write the output and error files (lines in input order) and end the batch: completed, or cancelled, with the
    usage of the output file's lines."""
    batch_id = batch["id"]
    ids: dict[str, str | None] = {}
    usage, model = wire.no_usage(), batch.get("model")
    for status, key in (("completed", "output_file_id"), ("failed", "error_file_id")):
        file_id = f"file-{batch_id.removeprefix('batch_')}-{'output' if status == 'completed' else 'errors'}"
        await store.delete_file(file_id)  # an earlier, interrupted finalize's

        async def jsonl(kept: str = status) -> AsyncIterator[bytes]:
            # NOTE(server): the usage is summed from the lines as they are written out, so it is the output file's
            # by construction (each stored line once, whatever happened before a restart)
            nonlocal usage, model
            async for result in store.line_results(batch_id, kept):
                if kept == "completed":
                    usage = wire.add_usage(usage, result)
                    model = model or wire.answered_model(result)
                yield (json.dumps(result, ensure_ascii=False) + "\n").encode("utf-8")

        record = await store.put_file(FileRecord(file_id, time.time(), f"{batch_id}_{key.split('_')[0]}.jsonl",
                                                 "batch_output", 0), jsonl(), 1 << 62)
        ids[key] = file_id if record.bytes else None
        if not record.bytes:
            await store.delete_file(file_id)
    counts = await store.line_counts(batch_id)
    end = ("cancelled" if batch["status"] == "cancelling" else "expired" if time.time() > batch["expires_at"]
           else "completed")
    await store.update_batch(batch_id, wire.moved(batch, end, request_counts=counts, usage=usage, model=model, **ids))
    logger.info("batch %s %s: %d completed, %d failed of %d", batch_id, end, counts["completed"], counts["failed"],
                counts["total"])
