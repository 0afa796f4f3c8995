"""The engine process's side of several API processes (``--api-server-count``): one pipe per API process beside the
parent's control pipe; each pipe's reader feeds the one core, and the core's outputs are split per client.

Only engine.core_process uses this module, and only when it was started with client pipes (engine.core_attach);
a one-process server never reaches it. No onnxruntime import.

Routing: API process ``i`` of ``n`` numbers its requests ``seq = i (mod n)`` (AsyncEngine), so an output goes to
client ``out.seq % n`` with no table to keep. Snapshots, ``Ready`` and ``CoreDied`` go to every client.
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from engine.core_wire import (
    AbortRequests, AddRequest, FromCore, PrepareGrammar, Shutdown, SnapshotUpdate, StepOutputs, dumps,
    encode_outputs, loads,
)
from engine.types import CoreOutput

log = logging.getLogger(__name__)


class SnapshotPacing:
    """When the core's counters (its snapshot) go to the API side: with a step's outputs when one of them finishes a
    request or ``interval_s`` has passed since the last one sent, and between steps when the core idles or has sent
    none for ``interval_s``. The outboxes (engine.core_process._Outbox, FanOutbox) send; they record what they sent
    in ``_sent_snapshot`` and ``_sent_s``."""

    def __init__(self, interval_s: float) -> None:
        self.core: Any = None
        self._interval_s = interval_s
        self._sent_snapshot: Any = None
        self._sent_s = 0.0

    def _step_snapshot(self, outputs: list[CoreOutput]) -> Any:
        """The snapshot to send with these outputs, or None."""
        core = self.core
        if core is not None and (time.monotonic() - self._sent_s >= self._interval_s
                                 or any(out.finish_reason is not None for out in outputs)):
            return core.snapshot
        return None

    def _idle_snapshot(self, idle: bool) -> Any:
        """The snapshot to send between steps, or None (unchanged since sent, or not due)."""
        snapshot = self.core.snapshot if self.core is not None else None
        if snapshot is None or snapshot is self._sent_snapshot:
            return None
        return snapshot if idle or time.monotonic() - self._sent_s >= self._interval_s else None


class FanOutbox(SnapshotPacing):
    """The core's sink with several clients: a sink call's outputs split by ``seq % n`` into one ``StepOutputs`` per
    client that has any; the snapshot, when due, to every client (a ``SnapshotUpdate`` where it has no outputs).

    Same surface as engine.core_process._Outbox (``core``, ``__call__``, ``between_steps``, ``send``); ``send``
    goes to the control pipe and every client. A client whose pipe breaks (its API process ended) is dropped; the core
    keeps running for the others (the parent stops the server when an API process ends).

    Args:
        control: the parent's pipe (``Ready``/``LoadFailed``, ``CoreDied``).
        clients: one pipe per API process, in client order.
        snapshot_interval_s: as _Outbox's: the most time between two snapshots while outputs flow.
    """

    def __init__(self, control: Connection, clients: list[Connection], snapshot_interval_s: float) -> None:
        super().__init__(snapshot_interval_s)
        self.control = control
        self.clients: list[Connection | None] = list(clients)
        self._lock = threading.Lock()  # the core thread and the readers (refused adds) both send
        self.broken = False  # the control pipe broke: the parent is gone

    def __call__(self, outputs: list[CoreOutput]) -> None:
        snapshot = self._step_snapshot(outputs)
        cpu_s = time.process_time() if snapshot is not None else None
        n = len(self.clients)
        groups: list[list[CoreOutput]] = [[] for _ in range(n)]
        for out in outputs:
            groups[out.seq % n].append(out)
        update = dumps(SnapshotUpdate(snapshot, cpu_s)) if snapshot is not None else None
        messages = [dumps(StepOutputs(encode_outputs(group), snapshot, cpu_s)) if group else update
                    for group in groups]
        self._send_each(messages, snapshot)

    def between_steps(self, idle: bool) -> None:
        snapshot = self._idle_snapshot(idle)
        if snapshot is not None:
            data = dumps(SnapshotUpdate(snapshot, time.process_time()))
            self._send_each([data] * len(self.clients), snapshot)

    def send(self, message: FromCore, snapshot: Any = None) -> None:
        """``message`` to the parent and to every client."""
        data = dumps(message)
        with self._lock:
            if not self.broken:
                try:
                    self.control.send_bytes(data)
                except (OSError, ValueError):
                    self.broken = True
        self._send_each([data] * len(self.clients), snapshot)

    def detach(self, index: int) -> None:
        """Client ``index`` has gone (EOF) or said ``Shutdown``: nothing more goes to it; its pipe closes, which its
        reader sees as EOF."""
        with self._lock:
            conn, self.clients[index] = self.clients[index], None
        if conn is not None:
            conn.close()

    def _send_each(self, messages: list[bytes | None], snapshot: Any) -> None:
        with self._lock:
            if snapshot is not None:
                self._sent_snapshot, self._sent_s = snapshot, time.monotonic()
            for index, data in enumerate(messages):
                conn = self.clients[index]
                if data is None or conn is None:
                    continue
                try:
                    conn.send_bytes(data)
                except (OSError, ValueError):  # that API process is gone: the others go on
                    log.warning("API process %d has gone; its outputs are dropped", index)
                    self.clients[index] = None


def serve_client(conn: Connection, index: int, feed: Any, outbox: FanOutbox) -> None:
    """Reader thread of client ``index``: its adds, aborts and grammar hints go to the shared feed in the order it
    sent them; its ``Shutdown`` or EOF detaches it (the engine goes on: only the parent's pipe stops it).

    NOTE(engine): an API process aborts its requests still in flight before it detaches (AsyncEngine.shutdown); one
    that dies leaves them to run out (their outputs are dropped) until the parent, which saw it die, stops the engine.
    """
    while True:
        try:
            message = loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if isinstance(message, Shutdown):
            break
        if isinstance(message, (AddRequest, AbortRequests, PrepareGrammar)):
            feed.put(message)
    outbox.detach(index)


def start_client_readers(clients: list[Connection], feed: Any, outbox: FanOutbox) -> None:
    """One reader thread per client pipe (daemon threads: the process ends with its core)."""
    for index, conn in enumerate(clients):
        threading.Thread(target=serve_client, args=(conn, index, feed, outbox), name=f"ortserve-engine-client-{index}",
                         daemon=True).start()
