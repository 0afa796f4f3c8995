"""A JSON-lines record of where a running stream can stall: the engine's steps (when each began, by the wall clock, to
line up with a client's token times; how long it and each of its phases took; what it ran; how long the core sat
between steps), every pause of the garbage collector, and (the server's side) its event loop's late wake-ups.
Stdlib only.

One object per line; "proc" says which process wrote it ("engine" or "server": with an engine process, two):
  {"t": wall s, "ms": step, "idle_ms": since the last step ended, "decode": rows, "prefill": [tokens per chunk],
   "prefill_start": [the position each chunk starts at (> 0: after a past)], "joined": prompts whose last token
   joined the decode run, "copies": KV row copies, "verify": draft checks,
   "phases_ms": {phase: ms, ...} (the non-zero ones), "runs": [[session, ms], ...] (each session run, in order)}
  {"t": wall s, "gc": generation, "ms": pause, "thread": name, "proc": ...}
  {"t": wall s, "lag": true, "ms": how late the event loop woke, "proc": "server"}

Turned on by ``EngineConfig.step_trace`` (``--step-trace FILE``); off, nothing calls it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO


class TraceFile:
    """Appends JSON lines to ``path`` (line-buffered, one write per line, so processes sharing the file interleave
    whole lines) and, with ``collections``, one line per garbage collection in this process."""

    def __init__(self, path: str, proc: str, *, collections: bool = True) -> None:
        self.proc = proc
        self._file: TextIO | None = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()  # NOTE(engine): collections run on whichever thread allocates
        # NOTE(engine): wall = perf_counter + offset: times come from perf_counter (monotonic, cheap), a line carries
        # the wall clock a client on the same host also reads
        self.offset = time.time() - time.perf_counter()
        self._gc_start = 0.0
        self._collections = collections
        if collections:
            gc.callbacks.append(self._on_gc)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)

    def close(self) -> None:
        if self._collections:
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
        self.write({"t": round(self._gc_start + self.offset, 6), "gc": info.get("generation"),
                    "ms": round((now - self._gc_start) * 1e3, 3), "thread": threading.current_thread().name,
                    "proc": self.proc})


class StepTrace(TraceFile):
    """The engine core's steps (``step``) and its process's garbage collections."""

    def __init__(self, path: str, phases: Sequence[str]) -> None:
        super().__init__(path, "engine")
        self.phases = tuple(phases)
        self._last_end: float | None = None

    def step(self, start: float, end: float, phases_before: Sequence[float], phases_after: Sequence[float], *,
             decode: int, prefill: Sequence[int], prefill_start: Sequence[int], joined: int, copies: int,
             verify: int, runs: Sequence[tuple[str, float]] = ()) -> None:
        """One step that ran from ``start`` to ``end`` (perf_counter seconds); the core's phase totals before and
        after it."""
        idle = (start - self._last_end) * 1e3 if self._last_end is not None else None
        self._last_end = end
        phases = {name: round((b - a) * 1e3, 3) for name, a, b in zip(self.phases, phases_before, phases_after)
                  if b > a}
        self.write({"t": round(start + self.offset, 6), "ms": round((end - start) * 1e3, 3),
                    "idle_ms": None if idle is None else round(idle, 3), "decode": decode, "prefill": list(prefill),
                    "prefill_start": list(prefill_start), "joined": joined, "copies": copies, "verify": verify,
                    "phases_ms": phases, "runs": [list(r) for r in runs or ()]})


# NOTE(engine): the loop-lag probe sleeps this long and records wake-ups later than LAG_MIN_S (the probe's own cost:
# ~500 wake-ups a second while tracing)
LAG_PERIOD_S = 0.002
LAG_MIN_S = 0.005


async def watch_loop(trace: TraceFile, period_s: float = LAG_PERIOD_S, min_lag_s: float = LAG_MIN_S) -> None:
    """Until cancelled: sleep ``period_s`` on the running event loop, and record every wake-up over ``min_lag_s``
    late (a callback that held the loop, or the process not scheduled) as a "lag" line from when it was due."""
    clock = time.perf_counter
    while True:
        due = clock() + period_s
        await asyncio.sleep(period_s)
        late = clock() - due
        if late > min_lag_s:
            trace.write({"t": round(due + trace.offset, 6), "lag": True, "ms": round(late * 1e3, 3),
                         "proc": trace.proc})
