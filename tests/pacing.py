"""Test-only fault injectors (EngineConfig.fault_injector); those that pickle also work in an engine process.

`DecodeGate` holds decode runs while shut (in-process engines; tests import it from tests.conftest);
`ProcessDecodeGate` is the same gate over a multiprocessing Event and shared counters; `DecodePace` sleeps before
each decode step (tests/integration/server/paced_serve.py). No pytest import: the engine process imports this
module to unpickle them.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any


class DecodePace:
    """Sleeps `delay_s` before every decode step: a stream of N tokens lasts at least N * delay_s."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, info: Any) -> None:  # an engine.types.StepInfo
        if info.kind == "decode":
            time.sleep(self.delay_s)


class DecodeGate:
    """A test-only fault injector that holds every decode run while the gate is shut (prefill runs pass).

    With the gate shut a running request cannot finish, whatever the machine's speed: the test decides when
    the engine may go on.
    """

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._num_to_pass = 0
        self.num_held = 0

    def shut(self, after: int = 0) -> None:
        """Hold decode runs from now on, once `after` more have passed."""
        self._num_to_pass = after
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def wait_held(self, timeout_s: float = 30.0) -> bool:
        """Wait until a decode run is held at the gate (the request is running, its next token not yet made)."""
        deadline = time.monotonic() + timeout_s
        while self.num_held == 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def __call__(self, info) -> None:  # an engine.types.StepInfo
        if info.kind == "decode" and not self._open.is_set():
            if self._num_to_pass > 0:
                self._num_to_pass -= 1
                return
            self.num_held += 1
            self._open.wait(60)


class ProcessDecodeGate(DecodeGate):
    """DecodeGate for an engine in its own process: holds every decode run while shut.

    NOTE: its Event and counters are shared with the engine process when the engine is started with it in its
    EngineConfig (multiprocessing pickles them only then), so make one per engine, before the engine. Unlike
    DecodeGate, `num_held` counts from the last `shut`.
    """

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._open = ctx.Event()
        self._open.set()
        self._num_to_pass = ctx.Value("i", 0)
        self._num_held = ctx.Value("i", 0)

    @property
    def num_held(self) -> int:
        return self._num_held.value

    def shut(self, after: int = 0) -> None:
        """Hold decode runs from now on, once `after` more have passed."""
        self._num_to_pass.value = after
        self._num_held.value = 0
        self._open.clear()

    def __call__(self, info: Any) -> None:  # an engine.types.StepInfo, in the engine process
        if info.kind == "decode" and not self._open.is_set():
            with self._num_to_pass.get_lock():
                if self._num_to_pass.value > 0:
                    self._num_to_pass.value -= 1
                    return
            with self._num_held.get_lock():
                self._num_held.value += 1
            self._open.wait(60)
