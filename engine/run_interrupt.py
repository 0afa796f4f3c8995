"""RunInterrupt: stops a model run of batch rows only (priority > 0) when an interactive request arrives, so that the
request's prompt runs next instead of after the batch run in flight. No onnxruntime import: the runner hands in the
``RunOptions`` its interruptible runs go through (anything with a ``terminate`` attribute).

NOTE(engine): a stopped run is dropped whole: the core advances no request by it (``update_from_output`` is never
called for it), so each of its rows is scheduled again from where it was. Its KV writes are harmless: a run writes
a row's KV only at the positions it computes (past and present share one buffer), at or after what the row holds,
and a later run writes each such position again before any token attends to it (every layer writes its new
positions before it attends over them). Decode rows, prompt chunks and whole prompts run together are all of that
kind. Draft checks and the draft model's runs are not armed (short runs of one row, whose drafts the scheduler
chose when it scheduled them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class RunInterrupted(Exception):
    """The run was stopped (``started``) or never started because an interactive request arrived; nothing of it
    counts."""

    def __init__(self, started: bool) -> None:
        super().__init__("an interactive request arrived" if started else "an interactive request is waiting")
        self.started = started


class RunInterrupt:
    """The handshake between the threads that add requests and the core thread that runs the model.

    Usage (core thread)::

        with interrupt.batch_run(all(r.priority for r in rows)):
            runner.decode(...)   # raises RunInterrupted instead of what the stopped run raised

    and from any thread, as a request is queued: ``interrupt.arrived(request.priority)``.

    NOTE(engine): ``options.terminate`` is set only under the lock while a batch run is armed, and cleared under it
    when the run ends, so a run of an interactive request never starts with it set. ONNX Runtime checks the flag
    between nodes: a decode step of the default model stops within a node or two (well under a millisecond).

    Args:
        options: the RunOptions the runner passes to the runs made inside ``batch_run`` (``options``); None: runs
            can't be stopped (a captured graph's own options, a runner without one): only the check before a run
            applies.
    """

    def __init__(self, options: Any | None) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._armed = False
        self._pending = False  # an interactive request arrived since the core last drained its inbox

    @property
    def armed(self) -> bool:
        """A batch run is in flight (core thread only): the runner passes ``options`` to it."""
        return self._armed

    def arrived(self, priority: int) -> None:
        """A request of ``priority`` was queued for the core (any thread): an interactive one stops the batch run in
        flight, and keeps the core from starting another before it drains its inbox."""
        if priority:
            return
        with self._lock:
            self._pending = True
            if self._armed and self.options is not None:
                self.options.terminate = True

    def drained(self) -> None:
        """The core is about to drain its inbox (core thread): the requests that arrived so far are taken."""
        with self._lock:
            self._pending = False

    @contextmanager
    def batch_run(self, batch_only: bool) -> Iterator[None]:
        """Run the body as a batch run when ``batch_only`` (else as is): it raises RunInterrupted when an
        interactive request is waiting before it starts or arrives while it runs."""
        if not batch_only:
            yield
            return
        with self._lock:
            if self._pending:
                raise RunInterrupted(started=False)
            self._armed = True
        try:
            yield
        except Exception as exc:
            if self._disarm():
                raise RunInterrupted(started=True) from exc
            raise
        self._disarm()  # NOTE(engine): set after the run ended: its results stand

    def _disarm(self) -> bool:
        """End the armed run; returns whether its terminate flag was set."""
        with self._lock:
            self._armed = False
            if self.options is None:
                return False
            stopped = bool(self.options.terminate)
            self.options.terminate = False
            return stopped
