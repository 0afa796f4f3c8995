"""The state store's one interface (``Store``) and the records it hands out.

Everything that outlives a request lives behind this interface: stored and background responses with their events,
conversations and their items, files, batches and their lines. The protocol packages call it; none of them writes
SQL. Two backends implement it (server.store.sql: SQLite embedded, PostgreSQL for several processes or replicas).
No onnxruntime, no engine import.
"""

from __future__ import annotations

import abc
import os
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# Statuses of a Response that is still running (a background response's claim matters only then).
RESPONSE_RUNNING = ("queued", "in_progress")
# Statuses of a batch a worker runs (validating: its input file is being read into lines).
BATCH_RUNNING = ("validating", "in_progress", "finalizing", "cancelling")


def _process_start_s(pid: int) -> float | None:
    """When process ``pid`` started (Unix seconds, to the clock tick), from /proc; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, after the command's parentheses
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def worker_id() -> str:
    """This process as a lease owner: host, pid and start time (a reused pid is another owner)."""
    return f"{socket.gethostname()}/{os.getpid()}/{_process_start_s(os.getpid()) or 0:.0f}"


def owner_alive(owner: str) -> bool | None:
    """Whether the process that ``owner`` names is still running: None when it ran on another host (only its lease
    can tell then)."""
    host, _, rest = owner.partition("/")
    pid_text, _, start = rest.partition("/")
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    started = _process_start_s(int(pid_text))
    if started is None:
        return False if not os.path.exists(f"/proc/{pid_text}") else None
    return abs(started - float(start or 0)) <= 1.0


@dataclass(frozen=True)
class ResponseRecord:
    """A stored Response.

    Attributes:
        body: the Response object as the API returns it.
        conversation: chat messages of the thread up to and including this response's output, without its
            instructions (what previous_response_id continues).
        input_items: this request's input items, each with an id (GET .../input_items).
        request: a background response's request body (run again if its owner dies before it ends).
        num_bytes: what the size bound counts (the JSON of the three above).
    """

    id: str
    created_at: float
    status: str
    body: dict[str, Any]
    conversation: list[dict[str, Any]] = field(default_factory=list)
    input_items: list[dict[str, Any]] = field(default_factory=list)
    background: bool = False
    request: dict[str, Any] | None = None
    num_bytes: int = 0
    owner: str | None = None
    cancel_requested: bool = False


@dataclass(frozen=True)
class ConversationRecord:
    id: str
    created_at: float
    metadata: dict[str, str]


@dataclass(frozen=True)
class FileRecord:
    id: str
    created_at: float
    filename: str
    purpose: str
    bytes: int
    expires_at: float | None = None


@dataclass(frozen=True)
class BatchRecord:
    """A batch: ``body`` is the Batch object as the API returns it (status, counts, times and file ids)."""

    id: str
    created_at: float
    status: str
    body: dict[str, Any]
    owner: str | None = None


@dataclass(frozen=True)
class BatchLine:
    """One input line: ``request`` its parsed JSON (None: the line did not parse), ``result`` its output or error
    file line once run."""

    line_no: int
    status: str  # pending | completed | failed
    request: dict[str, Any] | None = None
    result: dict[str, Any] | None = None


@dataclass(frozen=True)
class Page:
    """One page of a listing, in the order asked for."""

    data: list[Any]
    has_more: bool


class StoreFullError(Exception):
    """A write would pass one of the store's size limits."""


class Store(abc.ABC):
    """Where state that outlives a request lives; every method is a coroutine and safe to call from any process
    that opened the same database.

    Usage::

        store = open_store(settings)          # server.store.open_store
        await store.start()                   # migrations to the newest schema, then the connection pool
        await store.put_response(record)
        record = await store.get_response("resp_...")
        await store.close()
    """

    url: str  # the database, password hidden

    @abc.abstractmethod
    async def start(self) -> None:
        """Bring the schema up to date (under a lock: several processes may start at once) and connect."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    # --- responses --------------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def put_response(self, record: ResponseRecord, lease_s: float | None = None) -> None:
        """Insert or replace a response; ``lease_s``: the caller owns it (a background run) for that long."""

    @abc.abstractmethod
    async def get_response(self, response_id: str) -> ResponseRecord | None: ...

    @abc.abstractmethod
    async def update_response(self, response_id: str, *, status: str, body: dict[str, Any],
                              conversation: list[dict[str, Any]] | None = None) -> bool:
        """Set a response's status and body (and, once it ends, its conversation); False if it is gone."""

    @abc.abstractmethod
    async def delete_response(self, response_id: str) -> bool: ...

    @abc.abstractmethod
    async def request_cancel(self, response_id: str) -> ResponseRecord | None:
        """Mark a background response to be cancelled (its owner stops it); the record as it stands."""

    @abc.abstractmethod
    async def append_events(self, response_id: str, events: Sequence[dict[str, Any]]) -> None:
        """Keep a background response's events (each has its ``sequence_number``)."""

    @abc.abstractmethod
    async def events_after(self, response_id: str, after: int, limit: int = 1000) -> list[dict[str, Any]]:
        """Stored events whose sequence_number is greater than ``after``, in order."""

    @abc.abstractmethod
    async def drop_events(self, response_id: str) -> None:
        """Forget a response's events (it runs again from its start)."""

    # --- conversations ----------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def create_conversation(self, record: ConversationRecord, items: Sequence[dict[str, Any]]) -> None: ...

    @abc.abstractmethod
    async def get_conversation(self, conversation_id: str) -> ConversationRecord | None: ...

    @abc.abstractmethod
    async def update_conversation(self, conversation_id: str, metadata: dict[str, str]) -> ConversationRecord | None:
        ...

    @abc.abstractmethod
    async def delete_conversation(self, conversation_id: str) -> bool: ...

    @abc.abstractmethod
    async def add_items(self, conversation_id: str, items: Sequence[dict[str, Any]]) -> bool:
        """Append items (each with its id) to a conversation; False if it does not exist."""

    @abc.abstractmethod
    async def list_items(self, conversation_id: str, order: str, limit: int, after: str | None) -> Page:
        """Items after the item ``after`` in ``order`` ('asc' or 'desc')."""

    @abc.abstractmethod
    async def all_items(self, conversation_id: str) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    async def get_item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    async def delete_item(self, conversation_id: str, item_id: str) -> bool: ...

    # --- files ------------------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def put_file(self, record: FileRecord, chunks: AsyncIterator[bytes], max_bytes: int) -> FileRecord:
        """Store a file from its chunks; StoreFullError once it passes ``max_bytes`` (nothing is kept then).
        Returns the record with its size."""

    @abc.abstractmethod
    async def get_file(self, file_id: str) -> FileRecord | None: ...

    @abc.abstractmethod
    async def list_files(self, purpose: str | None, order: str, limit: int, after: str | None) -> Page: ...

    @abc.abstractmethod
    async def delete_file(self, file_id: str) -> bool: ...

    @abc.abstractmethod
    def file_content(self, file_id: str) -> AsyncIterator[bytes]:
        """A file's bytes, chunk by chunk."""

    # --- batches ----------------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def put_batch(self, record: BatchRecord, lease_s: float | None = None) -> None:
        """Keep a new batch; ``lease_s``: its ``owner`` runs it (claimed for that long)."""

    @abc.abstractmethod
    async def get_batch(self, batch_id: str) -> BatchRecord | None: ...

    @abc.abstractmethod
    async def list_batches(self, limit: int, after: str | None) -> Page:
        """Newest first, as OpenAI lists them."""

    @abc.abstractmethod
    async def update_batch(self, batch_id: str, body: dict[str, Any], *, only_if: Sequence[str] = ()) -> bool:
        """Replace a batch's object (its status is ``body['status']``); with ``only_if``, only while its status is
        one of those. False when nothing changed."""

    @abc.abstractmethod
    async def put_lines(self, batch_id: str, lines: Sequence[BatchLine]) -> None:
        """A batch's input lines (replacing any from an earlier, interrupted read)."""

    @abc.abstractmethod
    async def pending_lines(self, batch_id: str, limit: int, after: int = -1) -> list[BatchLine]:
        """Lines not yet run, in order, numbered after ``after``."""

    @abc.abstractmethod
    async def finish_line(self, batch_id: str, line_no: int, status: str, result: dict[str, Any]) -> bool:
        """Record a line's result, once: False when it was already recorded (never written twice)."""

    @abc.abstractmethod
    async def line_counts(self, batch_id: str) -> dict[str, int]:
        """{'total', 'completed', 'failed'} of a batch's lines."""

    @abc.abstractmethod
    def line_results(self, batch_id: str, status: str) -> AsyncIterator[dict[str, Any]]:
        """The results of the lines with ``status``, in line order."""

    # --- who runs what ----------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def claim(self, kind: str, owner: str, lease_s: float) -> list[str]:
        """Take over the running items of ``kind`` ('responses' or 'batches') whose lease ran out or whose owner's
        process is gone; returns their ids (now owned by ``owner`` for ``lease_s``)."""

    @abc.abstractmethod
    async def renew(self, kind: str, ids: Sequence[str], owner: str, lease_s: float) -> None: ...

    # --- limits -----------------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def sweep(self, now: float, retention_s: float, max_responses: int, max_response_bytes: int) -> int:
        """Delete what is older than ``retention_s`` (0: keep), expired files, and the oldest finished responses
        past ``max_responses`` or ``max_response_bytes``; returns how many rows went."""
