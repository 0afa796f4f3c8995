"""The rows of the state store, one mixin per kind (responses, conversations, files, batches), on SQLAlchemy Core:
the SQL the two backends of server.store.sql share. No onnxruntime, no engine import.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

import server.store.tables as t
from server.store.base import (BATCH_RUNNING, RESPONSE_RUNNING, BatchLine, BatchRecord, ConversationRecord, FileRecord,
                               Page, ResponseRecord, StoreFullError)

# NOTE(store): a file's bytes go into rows of this size: big enough that a file is few rows, small enough that
# reading one back never holds much memory.
CHUNK_BYTES = 1024 * 1024


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _response(row: Any) -> ResponseRecord:
    return ResponseRecord(row.id, row.created_at, row.status, row.body, row.conversation, row.input_items,
                          row.background, row.request, row.num_bytes, row.owner, row.cancel_requested)


def _file(row: Any) -> FileRecord:
    return FileRecord(row.id, row.created_at, row.filename, row.purpose, row.bytes, row.expires_at)


class _Rows:
    """What every mixin uses: a write transaction and a read connection (server.store.sql.SQLStore makes them)."""

    def _write(self) -> Any:
        raise NotImplementedError

    def _read(self) -> Any:
        raise NotImplementedError


class ResponseRows(_Rows):
    # --- responses --------------------------------------------------------------------------------------------

    async def put_response(self, record: ResponseRecord, lease_s: float | None = None) -> None:
        values = dict(id=record.id, created_at=record.created_at, status=record.status, background=record.background,
                      body=record.body, conversation=record.conversation, input_items=record.input_items,
                      request=record.request, num_bytes=record.num_bytes, cancel_requested=False,
                      owner=record.owner if lease_s is not None else None,
                      lease_until=time.time() + lease_s if lease_s is not None else None)
        async with self._write() as conn:
            await conn.execute(t.responses.delete().where(t.responses.c.id == record.id))
            await conn.execute(t.responses.insert().values(**values))

    async def get_response(self, response_id: str) -> ResponseRecord | None:
        async with self._read() as conn:
            row = (await conn.execute(t.responses.select().where(t.responses.c.id == response_id))).first()
        return _response(row) if row is not None else None

    async def update_response(self, response_id: str, *, status: str, body: dict[str, Any],
                              conversation: list[dict[str, Any]] | None = None) -> bool:
        values: dict[str, Any] = {"status": status, "body": body}
        if conversation is not None:
            values["conversation"] = conversation
            values["num_bytes"] = len(dumps(body)) + len(dumps(conversation))
        if status not in RESPONSE_RUNNING:
            values.update(owner=None, lease_until=None)
        async with self._write() as conn:
            result = await conn.execute(t.responses.update().where(t.responses.c.id == response_id).values(**values))
        return result.rowcount > 0

    async def delete_response(self, response_id: str) -> bool:
        async with self._write() as conn:
            await conn.execute(t.response_events.delete().where(t.response_events.c.response_id == response_id))
            result = await conn.execute(t.responses.delete().where(t.responses.c.id == response_id))
        return result.rowcount > 0

    async def request_cancel(self, response_id: str) -> ResponseRecord | None:
        async with self._write() as conn:
            await conn.execute(t.responses.update().where(t.responses.c.id == response_id,
                                                          t.responses.c.status.in_(RESPONSE_RUNNING))
                               .values(cancel_requested=True))
            row = (await conn.execute(t.responses.select().where(t.responses.c.id == response_id))).first()
        return _response(row) if row is not None else None

    async def append_events(self, response_id: str, events: Sequence[dict[str, Any]]) -> None:
        if not events:
            return
        async with self._write() as conn:
            await conn.execute(t.response_events.insert(), [
                {"response_id": response_id, "seq": e["sequence_number"], "event": e} for e in events])

    async def events_after(self, response_id: str, after: int, limit: int = 1000) -> list[dict[str, Any]]:
        c = t.response_events.c
        async with self._read() as conn:
            rows = await conn.execute(sa.select(c.event).where(c.response_id == response_id, c.seq > after)
                                      .order_by(c.seq).limit(limit))
            return [row.event for row in rows]

    async def drop_events(self, response_id: str) -> None:
        async with self._write() as conn:
            await conn.execute(t.response_events.delete().where(t.response_events.c.response_id == response_id))



class ConversationRows(_Rows):
    # --- conversations ----------------------------------------------------------------------------------------

    async def create_conversation(self, record: ConversationRecord, items: Sequence[dict[str, Any]]) -> None:
        async with self._write() as conn:
            await conn.execute(t.conversations.insert().values(id=record.id, created_at=record.created_at,
                                                               metadata=record.metadata))
            await self._append_items(conn, record.id, items, 0)

    @staticmethod
    async def _append_items(conn: AsyncConnection, conversation_id: str, items: Sequence[dict[str, Any]],
                            start: int) -> None:
        if items:
            now = time.time()
            await conn.execute(t.conversation_items.insert(), [
                {"conversation_id": conversation_id, "position": start + i, "id": item["id"], "item": item,
                 "created_at": now} for i, item in enumerate(items)])

    async def get_conversation(self, conversation_id: str) -> ConversationRecord | None:
        async with self._read() as conn:
            row = (await conn.execute(t.conversations.select().where(t.conversations.c.id == conversation_id))).first()
        return ConversationRecord(row.id, row.created_at, row.metadata) if row is not None else None

    async def update_conversation(self, conversation_id: str, metadata: dict[str, str]) -> ConversationRecord | None:
        async with self._write() as conn:
            await conn.execute(t.conversations.update().where(t.conversations.c.id == conversation_id)
                               .values(metadata=metadata))
        return await self.get_conversation(conversation_id)

    async def delete_conversation(self, conversation_id: str) -> bool:
        async with self._write() as conn:
            await conn.execute(t.conversation_items.delete()
                               .where(t.conversation_items.c.conversation_id == conversation_id))
            result = await conn.execute(t.conversations.delete().where(t.conversations.c.id == conversation_id))
        return result.rowcount > 0

    async def add_items(self, conversation_id: str, items: Sequence[dict[str, Any]]) -> bool:
        c = t.conversation_items.c
        async with self._write() as conn:
            exists = (await conn.execute(sa.select(t.conversations.c.id)
                                         .where(t.conversations.c.id == conversation_id)
                                         .with_for_update())).first()
            if exists is None:
                return False
            last = (await conn.execute(sa.select(sa.func.max(c.position))
                                       .where(c.conversation_id == conversation_id))).scalar()
            await self._append_items(conn, conversation_id, items, 0 if last is None else last + 1)
        return True

    async def list_items(self, conversation_id: str, order: str, limit: int, after: str | None) -> Page:
        c = t.conversation_items.c
        query = sa.select(c.item).where(c.conversation_id == conversation_id)
        async with self._read() as conn:
            if after is not None:
                position = (await conn.execute(sa.select(c.position).where(c.conversation_id == conversation_id,
                                                                           c.id == after))).scalar()
                if position is None:
                    return Page([], False)
                query = query.where(c.position > position if order == "asc" else c.position < position)
            query = query.order_by(c.position if order == "asc" else c.position.desc()).limit(limit + 1)
            items = [row.item for row in await conn.execute(query)]
        return Page(items[:limit], len(items) > limit)

    async def all_items(self, conversation_id: str) -> list[dict[str, Any]]:
        c = t.conversation_items.c
        async with self._read() as conn:
            rows = await conn.execute(sa.select(c.item).where(c.conversation_id == conversation_id)
                                      .order_by(c.position))
            return [row.item for row in rows]

    async def get_item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        c = t.conversation_items.c
        async with self._read() as conn:
            return (await conn.execute(sa.select(c.item).where(c.conversation_id == conversation_id,
                                                               c.id == item_id))).scalar()

    async def delete_item(self, conversation_id: str, item_id: str) -> bool:
        c = t.conversation_items.c
        async with self._write() as conn:
            result = await conn.execute(t.conversation_items.delete().where(c.conversation_id == conversation_id,
                                                                            c.id == item_id))
        return result.rowcount > 0



class FileRows(_Rows):
    # --- files ------------------------------------------------------------------------------------------------

    async def put_file(self, record: FileRecord, chunks: AsyncIterator[bytes], max_bytes: int) -> FileRecord:
        size, seq, pending = 0, 0, bytearray()
        async with self._write() as conn:
            await conn.execute(t.files.insert().values(id=record.id, created_at=record.created_at,
                                                       filename=record.filename, purpose=record.purpose, bytes=0,
                                                       expires_at=record.expires_at))
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise StoreFullError(f"the file is larger than {max_bytes} bytes")  # the transaction rolls back
                pending += chunk
                while len(pending) >= CHUNK_BYTES:
                    await conn.execute(t.file_chunks.insert().values(file_id=record.id, seq=seq,
                                                                     data=bytes(pending[:CHUNK_BYTES])))
                    del pending[:CHUNK_BYTES]
                    seq += 1
            if pending:
                await conn.execute(t.file_chunks.insert().values(file_id=record.id, seq=seq, data=bytes(pending)))
            await conn.execute(t.files.update().where(t.files.c.id == record.id).values(bytes=size))
        return FileRecord(record.id, record.created_at, record.filename, record.purpose, size, record.expires_at)

    async def get_file(self, file_id: str) -> FileRecord | None:
        async with self._read() as conn:
            row = (await conn.execute(t.files.select().where(t.files.c.id == file_id))).first()
        return _file(row) if row is not None else None

    async def list_files(self, purpose: str | None, order: str, limit: int, after: str | None) -> Page:
        c = t.files.c
        query = t.files.select()
        if purpose is not None:
            query = query.where(c.purpose == purpose)
        async with self._read() as conn:
            query = await self._after(conn, query, t.files, after, order)
            if query is None:
                return Page([], False)
            rows = [_file(row) for row in await conn.execute(query.limit(limit + 1))]
        return Page(rows[:limit], len(rows) > limit)

    @staticmethod
    async def _after(conn: AsyncConnection, query: Any, table: sa.Table, after: str | None, order: str) -> Any:
        """``query`` ordered by (created_at, id) in ``order``, starting after the row ``after`` (None: it is gone)."""
        c = table.c
        key = sa.tuple_(c.created_at, c.id)
        if after is not None:
            row = (await conn.execute(sa.select(c.created_at).where(c.id == after))).first()
            if row is None:
                return None
            mark = sa.tuple_(sa.literal(row.created_at), sa.literal(after))
            query = query.where(key > mark if order == "asc" else key < mark)
        return query.order_by(*((c.created_at, c.id) if order == "asc" else (c.created_at.desc(), c.id.desc())))

    async def delete_file(self, file_id: str) -> bool:
        async with self._write() as conn:
            await conn.execute(t.file_chunks.delete().where(t.file_chunks.c.file_id == file_id))
            result = await conn.execute(t.files.delete().where(t.files.c.id == file_id))
        return result.rowcount > 0

    async def file_content(self, file_id: str) -> AsyncIterator[bytes]:  # type: ignore[override]
        c = t.file_chunks.c
        seq = 0
        while True:
            async with self._read() as conn:
                data = (await conn.execute(sa.select(c.data).where(c.file_id == file_id, c.seq == seq))).scalar()
            if data is None:
                return
            yield bytes(data)
            seq += 1



class BatchRows(_Rows):
    # --- batches ----------------------------------------------------------------------------------------------

    async def put_batch(self, record: BatchRecord, lease_s: float | None = None) -> None:
        lease_until = time.time() + lease_s if lease_s is not None and record.owner is not None else None
        async with self._write() as conn:
            await conn.execute(t.batches.insert().values(id=record.id, created_at=record.created_at,
                                                         status=record.status, body=record.body, owner=record.owner,
                                                         lease_until=lease_until))

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        async with self._read() as conn:
            row = (await conn.execute(t.batches.select().where(t.batches.c.id == batch_id))).first()
        return BatchRecord(row.id, row.created_at, row.status, row.body, row.owner) if row is not None else None

    async def list_batches(self, limit: int, after: str | None) -> Page:
        async with self._read() as conn:
            query = await self._after(conn, t.batches.select(), t.batches, after, "desc")
            if query is None:
                return Page([], False)
            rows = [BatchRecord(r.id, r.created_at, r.status, r.body, r.owner)
                    for r in await conn.execute(query.limit(limit + 1))]
        return Page(rows[:limit], len(rows) > limit)

    async def update_batch(self, batch_id: str, body: dict[str, Any], *, only_if: Sequence[str] = ()) -> bool:
        values: dict[str, Any] = {"body": body, "status": body["status"]}
        if body["status"] not in BATCH_RUNNING:
            values.update(owner=None, lease_until=None)
        query = t.batches.update().where(t.batches.c.id == batch_id)
        if only_if:
            query = query.where(t.batches.c.status.in_(only_if))
        async with self._write() as conn:
            result = await conn.execute(query.values(**values))
        return result.rowcount > 0

    async def put_lines(self, batch_id: str, lines: Sequence[BatchLine]) -> None:
        async with self._write() as conn:
            await conn.execute(t.batch_lines.delete().where(t.batch_lines.c.batch_id == batch_id))
            for start in range(0, len(lines), 1000):
                await conn.execute(t.batch_lines.insert(), [
                    {"batch_id": batch_id, "line_no": line.line_no, "status": line.status, "request": line.request,
                     "result": line.result} for line in lines[start:start + 1000]])

    async def pending_lines(self, batch_id: str, limit: int, after: int = -1) -> list[BatchLine]:
        c = t.batch_lines.c
        async with self._read() as conn:
            rows = await conn.execute(sa.select(c.line_no, c.request)
                                      .where(c.batch_id == batch_id, c.status == "pending", c.line_no > after)
                                      .order_by(c.line_no).limit(limit))
            return [BatchLine(row.line_no, "pending", row.request) for row in rows]

    async def finish_line(self, batch_id: str, line_no: int, status: str, result: dict[str, Any]) -> bool:
        c = t.batch_lines.c
        async with self._write() as conn:
            done = await conn.execute(t.batch_lines.update()
                                      .where(c.batch_id == batch_id, c.line_no == line_no, c.status == "pending")
                                      .values(status=status, result=result))
        return done.rowcount > 0

    async def line_counts(self, batch_id: str) -> dict[str, int]:
        c = t.batch_lines.c
        async with self._read() as conn:
            rows = await conn.execute(sa.select(c.status, sa.func.count()).where(c.batch_id == batch_id)
                                      .group_by(c.status))
            counts = {row[0]: row[1] for row in rows}
        return {"total": sum(counts.values()), "completed": counts.get("completed", 0),
                "failed": counts.get("failed", 0)}

    async def line_results(self, batch_id: str, status: str) -> AsyncIterator[dict[str, Any]]:  # type: ignore[override]
        c = t.batch_lines.c
        after = -1
        while True:
            async with self._read() as conn:
                rows = list(await conn.execute(sa.select(c.line_no, c.result)
                                               .where(c.batch_id == batch_id, c.status == status, c.line_no > after)
                                               .order_by(c.line_no).limit(500)))
            for row in rows:
                yield row.result
            if len(rows) < 500:
                return
            after = rows[-1].line_no

