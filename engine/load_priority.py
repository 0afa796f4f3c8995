"""A loading engine process's lower CPU priority: a hub loads a model beside other models' running streams, and on a
few cores the load (tokenizer parsing, session creation, graph optimization) would take their share of the CPU.

Linux only (its nice value is per thread); elsewhere, or with ``nice`` 0, loading runs as before. No onnxruntime
import.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
_SUPPORTED = hasattr(os, "setpriority") and Path("/proc/self/task").is_dir()


def thread_nice(tid: int) -> int:
    """A thread's nice value (Linux: per thread; ``tid`` is its native id)."""
    return os.getpriority(os.PRIO_PROCESS, tid)


def can_restore_nice() -> bool:
    """Whether a thread of this process may lower its nice value again once raised (CAP_SYS_NICE, or an
    RLIMIT_NICE that allows it): probed on a throwaway thread."""
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        base = thread_nice(tid)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, base + 1))
            os.setpriority(os.PRIO_PROCESS, tid, base)
            result.append(thread_nice(tid) == base)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="ortserve-nice-probe")
    thread.start()
    thread.join()
    return bool(result and result[0])


class LoadPriority:
    """Runs loading steps at a nice value ``nice`` steps above the calling thread's, without leaving any thread that
    serves afterwards at that lower priority.

    NOTE(engine): a new thread inherits its creator's nice value, so ORT's intra-op pool threads, created with the
    session, get the loading thread's. Setting them back needs the right to lower a nice value (CAP_SYS_NICE or
    RLIMIT_NICE; most containers have neither). Where that right exists, every step runs on the calling thread at
    the lower priority, and the caller and each thread started meanwhile go back to the caller's nice value at the
    end (``restore``). Where it does not, only steps that start no lasting threads (reading the model folder: the
    tokenizer's parse is most of it) run at the lower priority, on a throwaway thread; the session is created at
    the caller's priority.

    Args:
        nice: how many nice steps lower (0: nothing changes).
    """

    def __init__(self, nice: int) -> None:
        self.nice = nice if _SUPPORTED else 0
        self._tid = threading.get_native_id()
        self._base = thread_nice(self._tid) if self.nice else 0
        self.restorable = bool(self.nice) and can_restore_nice()
        self._before: set[int] = set()
        if self.restorable:
            self._before = _thread_ids() - {self._tid}
            try:
                os.setpriority(os.PRIO_PROCESS, self._tid, min(19, self._base + self.nice))
            except OSError as exc:
                log.warning("cannot lower the loading thread's priority: %s", exc)
                self.restorable = False
        elif self.nice:
            log.info("loading: only the model folder is read at a lower CPU priority (this process cannot raise a "
                     "thread's priority back: no CAP_SYS_NICE or RLIMIT_NICE)")

    def call(self, fn: Callable[[], T], *, starts_threads: bool) -> T:
        """``fn()`` at the lower priority where that is safe (see the class note); ``starts_threads``: whether ``fn``
        starts threads that outlive it (creating an ORT session does)."""
        if not self.nice or self.restorable or starts_threads:
            return fn()
        outcome: list = []

        def run() -> None:
            tid = threading.get_native_id()
            try:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, thread_nice(tid) + self.nice))
            except OSError:
                pass
            try:
                outcome.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                outcome.append((False, exc))

        thread = threading.Thread(target=run, name="ortserve-load")
        thread.start()
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def restore(self) -> None:
        """Set the calling thread and every thread started since back to the caller's nice value (idempotent)."""
        if not self.restorable:
            return
        self.restorable = False
        for tid in _thread_ids() - self._before:
            try:
                if thread_nice(tid) != self._base:
                    os.setpriority(os.PRIO_PROCESS, tid, self._base)
            except OSError as exc:  # a thread that ended meanwhile (ESRCH)
                log.debug("thread %d: %s", tid, exc)


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}
