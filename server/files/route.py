"""/v1/files: upload (multipart), list, retrieve, delete, and /content. The bytes live in the state store, in
chunks, so every process and replica reads the same file; --file-max-bytes bounds an upload (413 above).
No onnxruntime import.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.types import InvalidRequestError
from server.errors import NotFoundError, TooLargeError
from server.responses.protocol import new_id
from server.state import get_state
from server.store import FileRecord, Store, StoreFullError

router = APIRouter(tags=["files"])

# OpenAI's purposes; what a client uploads is kept whatever its purpose (batch input is read by POST /v1/batches).
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
READ_BYTES = 256 * 1024


def file_object(record: FileRecord) -> dict[str, Any]:
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": int(record.created_at),
            "expires_at": int(record.expires_at) if record.expires_at is not None else None,
            "filename": record.filename, "purpose": record.purpose, "status": "processed", "status_details": None}


async def stored_file(store: Store, file_id: str, param: str = "file_id") -> FileRecord:
    record = await store.get_file(file_id)
    if record is None or (record.expires_at is not None and record.expires_at < time.time()):
        raise NotFoundError("file", file_id, param)
    return record


async def _chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(READ_BYTES):
        yield chunk


@router.post("/v1/files", response_model=None, summary="Upload a file")
async def upload_file(request: Request, file: UploadFile, purpose: str = Form(...),
                      expires_after_anchor: str | None = Form(None, alias="expires_after[anchor]"),
                      expires_after_seconds: int | None = Form(None, alias="expires_after[seconds]")) -> Response:
    if purpose not in PURPOSES:
        raise InvalidRequestError(f"purpose must be one of {list(PURPOSES)}, got {purpose!r}", param="purpose",
                                  code="invalid_value")
    now = time.time()
    expires_at = None
    if expires_after_seconds is not None:
        if expires_after_anchor not in (None, "created_at") or not 3600 <= expires_after_seconds <= 2_592_000:
            raise InvalidRequestError("expires_after needs anchor 'created_at' and seconds in [3600, 2592000], got "
                                      f"{expires_after_anchor!r} and {expires_after_seconds}",
                                      param="expires_after", code="invalid_value")
        expires_at = now + expires_after_seconds
    state = get_state(request)
    limit = state.settings.file_max_bytes
    record = FileRecord(new_id("file").replace("file_", "file-", 1), now, file.filename or "upload", purpose, 0,
                        expires_at)
    try:
        record = await state.store.put_file(record, _chunks(file), limit)
    except StoreFullError:
        raise TooLargeError(f"The file is larger than {limit} bytes (--file-max-bytes).") from None
    return JSONResponse(file_object(record))


@router.get("/v1/files", response_model=None, summary="List files")
async def list_files(request: Request, purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000),
                     order: Literal["asc", "desc"] = "desc", after: str | None = None) -> Response:
    page = await get_state(request).store.list_files(purpose, order, limit, after)
    data = [file_object(record) for record in page.data]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": page.has_more})


@router.get("/v1/files/{file_id}", response_model=None, summary="Retrieve a file")
async def retrieve_file(file_id: str, request: Request) -> Response:
    return JSONResponse(file_object(await stored_file(get_state(request).store, file_id)))


@router.delete("/v1/files/{file_id}", response_model=None, summary="Delete a file")
async def delete_file(file_id: str, request: Request) -> Response:
    if not await get_state(request).store.delete_file(file_id):
        raise NotFoundError("file", file_id, "file_id")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.get("/v1/files/{file_id}/content", response_model=None, summary="Retrieve a file's content")
async def file_content(file_id: str, request: Request) -> Response:
    store = get_state(request).store
    record = await stored_file(store, file_id)
    return StreamingResponse(store.file_content(file_id), media_type="application/octet-stream",
                             headers={"Content-Length": str(record.bytes),
                                      "Content-Disposition": f'attachment; filename="{record.filename}"'})
