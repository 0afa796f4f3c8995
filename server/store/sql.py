"""The state store's two backends on SQLAlchemy Core (asyncio): SQLiteStore, an embedded file (aiosqlite), and
PostgresStore, a database several processes and replicas share (psycopg). The SQL is written once (here and in
server.store.sql_rows); the backends differ only in how they connect and lock.

No onnxruntime, no engine import; the protocol packages never import this module (server.store.open_store does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import server.store.tables as t
from server.store.base import BATCH_RUNNING, RESPONSE_RUNNING, Store, owner_alive
from server.store.migrate import upgrade
from server.store.sql_rows import BatchRows, ConversationRows, FileRows, ResponseRows, dumps

logger = logging.getLogger(__name__)

_KINDS = {"responses": (t.responses, RESPONSE_RUNNING), "batches": (t.batches, BATCH_RUNNING)}


class SQLStore(ResponseRows, ConversationRows, FileRows, BatchRows, Store):
    """The Store on one SQLAlchemy async engine; subclasses say how to connect (``_make_engines``)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.url = sa.make_url(url).render_as_string(hide_password=True)
        self._engine: AsyncEngine | None = None  # writes (and reads, where the backend needs no other)
        self._reader: AsyncEngine | None = None

    # --- connecting -------------------------------------------------------------------------------------------

    def _make_engines(self) -> tuple[AsyncEngine, AsyncEngine]:
        engine = create_async_engine(self._url, json_serializer=dumps, pool_pre_ping=True)
        return engine, engine

    def _sync_url(self) -> str:
        """The URL a synchronous engine (the migrations) connects with."""
        return self._url

    async def start(self) -> None:
        import anyio

        await anyio.to_thread.run_sync(upgrade, self._sync_url())
        self._engine, self._reader = self._make_engines()
        logger.info("state store: %s", self.url)

    async def close(self) -> None:
        for engine in {self._engine, self._reader} - {None}:
            await engine.dispose()  # type: ignore[union-attr]
        self._engine = self._reader = None

    def _write(self) -> Any:
        if self._engine is None:
            raise RuntimeError("the state store is not started")
        return self._engine.begin()

    def _read(self) -> Any:
        if self._reader is None:
            raise RuntimeError("the state store is not started")
        return self._reader.connect()

    # --- who runs what ----------------------------------------------------------------------------------------

    async def claim(self, kind: str, owner: str, lease_s: float) -> list[str]:
        table, running = _KINDS[kind]
        c = table.c
        now = time.time()
        async with self._read() as conn:
            rows = list(await conn.execute(sa.select(c.id, c.owner, c.lease_until).where(c.status.in_(running))))
        if kind == "responses":
            rows = [r for r in rows if r.owner is not None]  # a response no one owns is a finished foreground one
        taken = []
        for row in rows:
            if row.owner == owner:
                continue
            expired = row.lease_until is None or row.lease_until < now
            if not expired and (row.owner is None or owner_alive(row.owner) is not False):
                continue
            # NOTE(store): compare-and-set on the owner and lease read above: of two processes taking over the
            # same row, one updates it and the other finds it changed.
            cas = table.update().where(c.id == row.id, c.status.in_(running))
            cas = cas.where(c.owner.is_(None) if row.owner is None else c.owner == row.owner)
            cas = cas.where(c.lease_until.is_(None) if row.lease_until is None else c.lease_until == row.lease_until)
            async with self._write() as conn:
                result = await conn.execute(cas.values(owner=owner, lease_until=now + lease_s))
            if result.rowcount:
                taken.append(row.id)
        return taken

    async def renew(self, kind: str, ids: Sequence[str], owner: str, lease_s: float) -> None:
        if not ids:
            return
        table, _ = _KINDS[kind]
        async with self._write() as conn:
            await conn.execute(table.update().where(table.c.id.in_(list(ids)), table.c.owner == owner)
                               .values(lease_until=time.time() + lease_s))

    # --- limits -----------------------------------------------------------------------------------------------

    async def sweep(self, now: float, retention_s: float, max_responses: int, max_response_bytes: int) -> int:
        removed = 0
        r = t.responses.c
        async with self._write() as conn:
            expired = [row.id for row in await conn.execute(
                sa.select(t.files.c.id).where(t.files.c.expires_at.is_not(None), t.files.c.expires_at < now))]
            if retention_s > 0:
                cutoff = now - retention_s
                expired += [row.id for row in await conn.execute(
                    sa.select(t.files.c.id).where(t.files.c.created_at < cutoff))]
                for table, items in ((t.responses, None), (t.conversations, t.conversation_items),
                                     (t.batches, t.batch_lines)):
                    old = sa.select(table.c.id).where(table.c.created_at < cutoff)
                    if table is t.responses:
                        old = old.where(r.status.not_in(RESPONSE_RUNNING))
                        await conn.execute(t.response_events.delete().where(t.response_events.c.response_id.in_(old)))
                    if table is t.batches:
                        old = old.where(t.batches.c.status.not_in(BATCH_RUNNING))
                    if items is not None:
                        fk = items.c.conversation_id if items is t.conversation_items else items.c.batch_id
                        await conn.execute(items.delete().where(fk.in_(old)))
                    removed += (await conn.execute(table.delete().where(table.c.id.in_(old)))).rowcount
            if expired:
                await conn.execute(t.file_chunks.delete().where(t.file_chunks.c.file_id.in_(expired)))
                removed += (await conn.execute(t.files.delete().where(t.files.c.id.in_(expired)))).rowcount
            # the newest finished responses within both bounds are kept
            rows = list(await conn.execute(sa.select(r.id, r.num_bytes).where(r.status.not_in(RESPONSE_RUNNING))
                                           .order_by(r.created_at.desc(), r.id.desc())))
            total, drop = 0, []
            for index, row in enumerate(rows):
                total += row.num_bytes
                if index >= max_responses or total > max_response_bytes:
                    drop.append(row.id)
            for start in range(0, len(drop), 500):
                part = drop[start:start + 500]
                await conn.execute(t.response_events.delete().where(t.response_events.c.response_id.in_(part)))
                removed += (await conn.execute(t.responses.delete().where(r.id.in_(part)))).rowcount
        return removed


class SQLiteStore(SQLStore):
    """An embedded SQLite file (the default: nothing to start). Processes of one server share it: WAL journal,
    writes in BEGIN IMMEDIATE transactions (so two writers queue on the busy timeout instead of failing)."""

    BUSY_TIMEOUT_MS = 30_000

    def _sync_url(self) -> str:
        return self._url.replace("sqlite+aiosqlite:", "sqlite:", 1)

    def _make_engines(self) -> tuple[AsyncEngine, AsyncEngine]:
        writer = create_async_engine(self._url, json_serializer=dumps)
        reader = create_async_engine(self._url, json_serializer=dumps)
        for engine, begin in ((writer, "BEGIN IMMEDIATE"), (reader, "BEGIN")):
            self._configure(engine, begin)
        return writer, reader

    def _configure(self, engine: AsyncEngine, begin: str) -> None:
        @event.listens_for(engine.sync_engine, "connect")
        def _connect(dbapi_connection: Any, _record: Any) -> None:
            # NOTE(store): SQLAlchemy's documented recipe: the driver issues no BEGIN of its own, ours says which
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA busy_timeout = {self.BUSY_TIMEOUT_MS}")
            # NOTE(store): WAL: readers never block the writer (a batch's output file is written while its lines
            # are read; in the rollback journal the writer's spill waits for the reader, which waits for it)
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.close()

        @event.listens_for(engine.sync_engine, "begin")
        def _begin(conn: Any) -> None:
            conn.exec_driver_sql(begin)


class PostgresStore(SQLStore):
    """A PostgreSQL database (``--state-url postgresql://...``), shared by every process and replica."""

    def _sync_url(self) -> str:
        return self._url

    def _make_engines(self) -> tuple[AsyncEngine, AsyncEngine]:
        engine = create_async_engine(self._url, json_serializer=dumps, pool_pre_ping=True, pool_size=5,
                                     max_overflow=10)
        return engine, engine
