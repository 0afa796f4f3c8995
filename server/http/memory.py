"""The C heap of the server process: one malloc arena, and memory given back shortly after large requests.

A large request (a prompt of megabytes) makes several large copies (the body, the parsed JSON, the rendered
prompt, the tokenizer's encoding at ~100 bytes a token), many in worker threads. glibc keeps freed memory for
reuse rather than return it, and malloc_trim never shrinks the top of a thread's own arena, so a few such
requests left the process hundreds of MB larger for good (issue 17). With a single arena (set before any
thread starts) and malloc_trim(0) once a large request is done, it goes back to the system. Everything here
is a no-op where the C library is not glibc. No onnxruntime import.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc's mallopt parameter


@functools.cache
def _glibc() -> Any | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def use_one_arena() -> bool:
    """Make every thread allocate from the main arena (call before other threads start); False if not glibc.

    NOTE(server): measured engine-direct on the default model, 2 cores, interleaved (3 rounds, a shared and
    loaded machine): decode tokens/s with one arena over glibc's default was 1.06x at batch 1 and 1.03x at
    batch 8 (median), i.e. no cost that the noise would show; Python's allocations are serialized by the GIL.
    """
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_ARENA_MAX, 1) == 1


def give_back_memory() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim(0); a few ms, drops the GIL)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class MemoryReclaim:
    """Runs give_back_memory in a worker thread `delay_s` after `soon()`, when nothing refers to the request's
    copies any more (one run pending at a time)."""

    def __init__(self, delay_s: float = 0.5) -> None:
        self.delay_s = delay_s
        self._pending = False

    def soon(self) -> None:
        if self._pending or _glibc() is None:
            return
        self._pending = True
        asyncio.get_running_loop().call_later(self.delay_s, self._run)

    def _run(self) -> None:
        self._pending = False
        asyncio.get_running_loop().run_in_executor(None, give_back_memory)
