"""CoreInbox: the engine core thread's queue of adds, aborts and the shutdown request. Any thread puts; only the
core thread takes. No onnxruntime import.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from engine.core_wire import AbortRequests
from engine.scheduler import Request

SHUTDOWN = object()  # the item that ends the core's loop


class CoreInbox:
    """Adds, aborts and ``SHUTDOWN``, in the order they were put.

    NOTE(engine): once the loop has ended (shutdown or death) the inbox is closed under a lock, so an add can never
    land in an inbox nobody drains (its caller would wait forever).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def add(self, request: Request) -> bool:
        """Queue ``request``; False (and nothing queued) once the inbox is closed."""
        with self._lock:
            if self._closed:
                return False
            self._queue.put(request)
            return True

    def abort(self, request_ids: Sequence[str], index: int | None = None) -> None:
        self._queue.put(AbortRequests(list(request_ids), index))

    def shutdown(self) -> None:
        self._queue.put(SHUTDOWN)

    def empty(self) -> bool:
        return self._queue.empty()

    def get(self, block: bool) -> object:
        """The next item (a Request, an AbortRequests or ``SHUTDOWN``); core thread only."""
        return self._queue.get(block=block)

    def close(self) -> list[Request]:
        """Refuse adds from now on; returns the requests added but never taken (they never reached the core)."""
        with self._lock:
            self._closed = True
        left = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return left
            if isinstance(item, Request):
                left.append(item)
