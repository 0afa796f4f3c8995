"""The state store (server.store) on its two backends, SQLite and PostgreSQL (a real cluster, tests/postgres.py):
the same calls, the same answers. Migrations, paging, files in chunks and their size limit, batch lines recorded
once, claims taken over from a dead owner or an expired lease, and the sweep's bounds."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from server.store import (BatchLine, BatchRecord, ConversationRecord, FileRecord, ResponseRecord, Store,
                          StoreFullError, open_store, store_url, worker_id)
from server.store.migrate import head_revision, upgrade


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "state.db")
        return
    base = request.getfixturevalue("postgres_url")
    # a database of its own per test, so tests never see each other's rows
    import sqlalchemy as sa

    name = f"t{time.monotonic_ns()}"
    admin = sa.create_engine(base.replace("postgresql://", "postgresql+psycopg://"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()
    yield base.rsplit("/", 1)[0] + f"/{name}"


def run(url: str, test) -> None:  # noqa: ANN001 - an async function of the store
    async def main() -> None:
        store = open_store(url)
        await store.start()
        try:
            await test(store)
        finally:
            await store.close()

    asyncio.run(main())


def response(rid: str, created: float, status: str = "completed", size: int = 10, **kwargs) -> ResponseRecord:
    return ResponseRecord(rid, created, status, {"id": rid, "status": status, "text": "é" * size},
                          [{"role": "user", "content": "hi"}], [{"id": f"msg_{rid}"}], num_bytes=size, **kwargs)


def test_urls_name_the_backend() -> None:
    assert store_url("/x/state.db") == "sqlite+aiosqlite:////x/state.db"
    assert store_url("sqlite:////x/s.db") == "sqlite+aiosqlite:////x/s.db"
    assert store_url("postgresql://u:p@h/db") == "postgresql+psycopg://u:p@h/db"
    assert store_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    with pytest.raises(ValueError, match="state-url"):
        store_url("mysql://h/db")


def test_responses_and_their_events(url: str) -> None:
    async def check(store: Store) -> None:
        now = time.time()
        await store.put_response(response("resp_a", now))
        got = await store.get_response("resp_a")
        assert got is not None and got.body["text"] == "é" * 10 and got.conversation[0]["content"] == "hi"
        assert await store.get_response("resp_b") is None
        await store.put_response(response("resp_bg", now, "in_progress", background=True, owner="me"), lease_s=5)
        await store.append_events("resp_bg", [{"sequence_number": i, "type": "x"} for i in range(5)])
        assert [e["sequence_number"] for e in await store.events_after("resp_bg", 2)] == [3, 4]
        assert (await store.request_cancel("resp_bg")).cancel_requested
        assert not (await store.request_cancel("resp_a")).cancel_requested  # finished: nothing to cancel
        assert await store.update_response("resp_bg", status="cancelled", body={"id": "resp_bg"}, conversation=[])
        assert (await store.get_response("resp_bg")).status == "cancelled"
        assert await store.delete_response("resp_bg") and not await store.delete_response("resp_bg")
        assert await store.events_after("resp_bg", -1) == []

    run(url, check)


def test_conversation_items_page_both_ways(url: str) -> None:
    async def check(store: Store) -> None:
        await store.create_conversation(ConversationRecord("conv_1", time.time(), {"k": "v"}),
                                        [{"id": f"i{n}"} for n in range(3)])
        assert await store.add_items("conv_1", [{"id": "i3"}, {"id": "i4"}])
        assert not await store.add_items("conv_none", [{"id": "x"}])
        page = await store.list_items("conv_1", "desc", 2, None)
        assert [i["id"] for i in page.data] == ["i4", "i3"] and page.has_more
        page = await store.list_items("conv_1", "asc", 10, "i2")
        assert [i["id"] for i in page.data] == ["i3", "i4"] and not page.has_more
        assert await store.delete_item("conv_1", "i3") and await store.get_item("conv_1", "i3") is None
        assert [i["id"] for i in await store.all_items("conv_1")] == ["i0", "i1", "i2", "i4"]
        assert (await store.update_conversation("conv_1", {"k": "w"})).metadata == {"k": "w"}
        assert await store.delete_conversation("conv_1") and await store.get_conversation("conv_1") is None
        assert await store.all_items("conv_1") == []

    run(url, check)


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_files_in_chunks_and_the_size_limit_keeps_nothing(url: str) -> None:
    async def check(store: Store) -> None:
        big = bytes(range(256)) * 9000  # 2.3 MB: three chunk rows
        record = await store.put_file(FileRecord("file-1", time.time(), "in.jsonl", "batch", 0),
                                      chunks(big[:1000], big[1000:]), len(big))
        assert record.bytes == len(big)
        assert b"".join([c async for c in store.file_content("file-1")]) == big
        with pytest.raises(StoreFullError):
            await store.put_file(FileRecord("file-2", time.time(), "x", "batch", 0), chunks(b"x" * 10, b"y" * 10), 15)
        assert await store.get_file("file-2") is None
        await store.put_file(FileRecord("file-3", time.time() + 1, "y", "user_data", 0), chunks(b"z"), 10)
        page = await store.list_files(None, "desc", 1, None)
        assert [f.id for f in page.data] == ["file-3"] and page.has_more
        assert [f.id for f in (await store.list_files(None, "desc", 5, "file-3")).data] == ["file-1"]
        assert [f.id for f in (await store.list_files("batch", "asc", 5, None)).data] == ["file-1"]
        assert await store.delete_file("file-1") and [c async for c in store.file_content("file-1")] == []

    run(url, check)


def test_a_batch_line_is_recorded_once_and_claims_move_only_from_dead_or_expired_owners(url: str) -> None:
    async def check(store: Store) -> None:
        dead = "thishost-that-is-not/1/1"
        await store.put_batch(BatchRecord("batch_1", time.time(), "in_progress", {"id": "batch_1",
                                                                                   "status": "in_progress"}))
        await store.put_lines("batch_1", [BatchLine(i, "pending", {"n": i}) for i in range(4)])
        assert await store.finish_line("batch_1", 1, "completed", {"n": 1})
        assert not await store.finish_line("batch_1", 1, "failed", {"n": -1})  # never twice
        assert [line.line_no for line in await store.pending_lines("batch_1", 10)] == [0, 2, 3]
        assert await store.line_counts("batch_1") == {"total": 4, "completed": 1, "failed": 0}
        me = worker_id()
        assert await store.claim("batches", me, 60) == ["batch_1"]  # nobody owned it
        assert await store.claim("batches", dead, 60) == []  # my lease holds and I am alive
        await store.renew("batches", ["batch_1"], me, -1)  # my lease ran out
        assert await store.claim("batches", dead, 60) == ["batch_1"]
        assert await store.claim("batches", me, 60) == []  # the other host's lease holds (can't see its pid)
        body = {"id": "batch_1", "status": "completed"}
        assert await store.update_batch("batch_1", body, only_if=("in_progress",))
        assert not await store.update_batch("batch_1", {**body, "status": "cancelled"}, only_if=("in_progress",))
        assert await store.claim("batches", me, 60) == []  # finished: nothing to run

    run(url, check)


def test_a_dead_local_owner_loses_its_background_response_at_once(url: str) -> None:
    async def check(store: Store) -> None:
        proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
        proc.start()
        proc.join()
        gone = worker_id().rsplit("/", 2)[0] + f"/{proc.pid}/0"  # this host, a pid that has exited
        await store.put_response(response("resp_x", time.time(), "in_progress", background=True, owner=gone),
                                 lease_s=3600)
        assert await store.claim("responses", worker_id(), 60) == ["resp_x"]

    run(url, check)


def test_the_sweep_keeps_the_newest_within_the_bounds(url: str) -> None:
    async def check(store: Store) -> None:
        now = time.time()
        for i in range(5):
            await store.put_response(response(f"resp_{i}", now - 100 + i, size=100))
        await store.put_response(response("resp_run", now - 1000, "in_progress", background=True, owner="x"),
                                 lease_s=60)
        await store.sweep(now, 0, 3, 10**9)  # at most 3 finished ones
        kept = [i for i in range(5) if await store.get_response(f"resp_{i}") is not None]
        assert kept == [2, 3, 4]
        await store.sweep(now, 0, 100, 250)  # about two of 100 bytes
        assert await store.get_response("resp_2") is None and await store.get_response("resp_3") is not None
        await store.sweep(now, 50, 100, 10**9)  # retention: everything finished older than 50 s
        assert await store.get_response("resp_4") is None
        assert await store.get_response("resp_run") is not None  # a running one is never swept

    run(url, check)


def _migrate(url: str) -> str:
    return upgrade(store_url(url).replace("+aiosqlite", "").replace("postgresql+psycopg", "postgresql+psycopg"))


def test_migrations_run_once_when_processes_start_together(url: str) -> None:
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        revisions = pool.map(_migrate, [url] * 3)
    assert revisions == [head_revision()] * 3
