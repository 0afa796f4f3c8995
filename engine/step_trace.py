"""A JSON-lines record of the engine's steps, for finding where a running stream stalled: when each step began (wall
clock, to line up with a client's token times), how long it and each of its phases took, what it ran, how long the
core sat between steps, and every pause of the garbage collector in the process. Stdlib only.

One object per line:
  {"t": wall s, "ms": step, "idle_ms": since the last step ended, "decode": rows, "prefill": [tokens per chunk],
   "prefill_start": [the position each chunk starts at (> 0: after a past)], "joined": prompts whose last token
   joined the decode run, "copies": KV row copies, "verify": draft checks,
   "phases_ms": {phase: ms, ...} (the non-zero ones), "runs": [[session, ms], ...] (each session run, in order)}
  {"t": wall s, "gc": generation, "ms": pause, "thread": name}

Turned on by ``EngineConfig.step_trace`` (``--step-trace FILE``); off, the core never calls it.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO


class StepTrace:
    """Writes the engine core's steps (``step``) and the process's garbage collections to ``path`` (appended)."""

    def __init__(self, path: str, phases: Sequence[str]) -> None:
        self.phases = tuple(phases)
        self._file: TextIO | None = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()  # NOTE(engine): collections run on whichever thread allocates
        # NOTE(engine): wall = perf_counter + offset: a step's times come from perf_counter (monotonic, cheap), its
        # line carries the wall clock a client on the same host also reads
        self._offset = time.time() - time.perf_counter()
        self._last_end: float | None = None
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def step(self, start: float, end: float, phases_before: Sequence[float], phases_after: Sequence[float], *,
             decode: int, prefill: Sequence[int], prefill_start: Sequence[int], joined: int, copies: int,
             verify: int, runs: Sequence[tuple[str, float]] = ()) -> None:
        """One step that ran from ``start`` to ``end`` (perf_counter seconds); the core's phase totals before and
        after it."""
        idle = (start - self._last_end) * 1e3 if self._last_end is not None else None
        self._last_end = end
        phases = {name: round((b - a) * 1e3, 3) for name, a, b in zip(self.phases, phases_before, phases_after)
                  if b > a}
        self._write({"t": round(start + self._offset, 6), "ms": round((end - start) * 1e3, 3),
                     "idle_ms": None if idle is None else round(idle, 3), "decode": decode, "prefill": list(prefill),
                     "prefill_start": list(prefill_start), "joined": joined, "copies": copies, "verify": verify,
                     "phases_ms": phases, "runs": [list(r) for r in runs or ()]})

    def close(self) -> None:
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        now = time.perf_counter()
        self._write({"t": round(self._gc_start + self._offset, 6), "gc": info.get("generation"),
                     "ms": round((now - self._gc_start) * 1e3, 3), "thread": threading.current_thread().name})

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
