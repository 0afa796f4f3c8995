"""The one interface AsyncEngine drives its core through (``CoreClient``), and its two implementations: the core
thread in this process (``InProcessCoreClient``) and the server process's end of an engine process
(``EngineCoreClient``, engine.core_process); ``make_core_client`` picks (``use_engine_process``).

Why a process: in one process the event loop (SSE, detokenizing) and the core thread take turns on the interpreter
lock (at 64 streams on a GPU the engine step took several times its own work: docs/perf/GPU.md). A reader thread
here receives each message of step outputs and hands them to the sink (AsyncEngine._dispatch) as the core thread does
in-process; what follows (OutputProcessor, stop strings) is unchanged.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util
import pickle
import signal
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from multiprocessing.connection import Connection

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_process import build_core, run_engine_process
from engine.core_wire import (
    AbortRequests, AddRequest, CoreDied, CoreFacts, FrameReader, LoadFailed, PrepareGrammar, Ready, Shutdown,
    SnapshotUpdate, StepOutputs, ToCore, decode_exception, decode_outputs, dumps, loads,
)
from engine.model_loader import ModelFolder
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler
from engine.structured_output import GrammarConstraint, StructuredOutputBackend
from engine.types import CoreSnapshot, EngineDeadError, EngineError, ModelLoadError, Sink, StructuredOutput

log = logging.getLogger(__name__)

class CoreClient(ABC):
    """Where an AsyncEngine's requests run: adds and aborts go in, each step's outputs come out through the sink it
    was built with (called on another thread: the core's, or the engine process reader's).

    Attributes:
        facts: what the loaded model reports (context length, vocabulary, KV bytes, placement, ...).
        structured: this process's grammar backend: it compiles (and so validates) each request's spec before
            the request is added.
        snapshot: the core's counters, as last published.
        dead: why the core stopped (None while it runs).
        process_cpu_s: the engine process's CPU seconds (all its threads); None in-process.
        runner: the model runner where it lives in this process, else None.
    """

    facts: CoreFacts
    structured: StructuredOutputBackend
    snapshot: CoreSnapshot
    dead: BaseException | None
    process_cpu_s: float | None = None
    runner: ModelRunner | None = None
    # NOTE(engine): an engine process shared by several API processes (engine.core_attach) sends each one the outputs
    # of the requests whose seq is its client_index modulo num_clients; AsyncEngine numbers its requests that way
    client_index: int = 0
    num_clients: int = 1

    @property
    def pid(self) -> int | None:
        """The engine process's id (None in-process)."""
        return None

    @abstractmethod
    def start(self) -> None:
        """Start running and delivering outputs (after the owner can take them)."""

    @abstractmethod
    def add(self, request: AddRequest, constraints: Sequence[GrammarConstraint | None]) -> None:
        """Queue a request, with the grammar this process compiled for each choice (all None without one);
        raises EngineDeadError once the core has stopped."""

    @abstractmethod
    def abort(self, request_ids: Sequence[str], index: int | None = None) -> None:
        """Stop requests (every choice, or only choice ``index`` of an n > 1 request); unknown ids are ignored."""

    def prepare_grammar(self, spec: StructuredOutput) -> None:
        """A request with ``spec`` is coming: start compiling it where the core runs (nothing to do in-process)."""

    @abstractmethod
    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort everything in flight (ABORT outputs) and stop; idempotent."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """Whether the core still runs."""


class InProcessCoreClient(CoreClient):
    """The core thread in this process (``engine.core_process.build_core``): the session, KV cache and scheduler
    share the interpreter with the event loop."""

    def __init__(self, folder: ModelFolder, config: EngineConfig, sink: Sink) -> None:
        built = build_core(folder, config, sink)
        self.core: EngineCore = built.core
        self.facts = built.facts()
        self.structured = built.structured
        self.runner = built.loaded.runner
        self._eos_token_ids = folder.eos_token_ids

    @property
    def scheduler(self) -> Scheduler:
        """The core thread's scheduler (tests and probes only: only the core thread may touch it)."""
        return self.core.scheduler

    @property
    def snapshot(self) -> CoreSnapshot:  # type: ignore[override]
        return self.core.snapshot

    @property
    def dead(self) -> BaseException | None:  # type: ignore[override]
        return self.core.dead

    def start(self) -> None:
        self.core.start()

    def add(self, request: AddRequest, constraints: Sequence[GrammarConstraint | None]) -> None:
        self.core.add(request.to_request(self._eos_token_ids, self.facts.max_model_len, constraints))

    def abort(self, request_ids: Sequence[str], index: int | None = None) -> None:
        self.core.abort(request_ids, index)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.core.shutdown(timeout_s)

    @property
    def alive(self) -> bool:
        return self.core.alive


def make_core_client(folder: ModelFolder, config: EngineConfig, sink: Sink) -> CoreClient:
    """The core for ``config``: in an engine process of its own, or a thread of this one (``use_engine_process``).

    Raises:
        ModelLoadError: the model can't be served on this device (ep/'s own errors propagate unchanged).
    """
    if use_engine_process(config):
        return EngineCoreClient(folder, config, sink)
    return InProcessCoreClient(folder, config, sink)


# NOTE(engine): engines nobody shut down are stopped at interpreter exit. multiprocessing's own exit handler would
# SIGTERM its daemon children (ignored by an engine process) and join them without a timeout while this process still
# holds the pipe, i.e. forever; this handler is registered after it, so it runs first.
_LIVE: weakref.WeakSet[EngineCoreClient] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    for client in list(_LIVE):
        client.shutdown(timeout_s=10.0)


# NOTE(engine): how long shutdown waits for the reader and the process after the core is joined in the child (the
# child joins its core within the caller's timeout first).
_REAP_S = 5.0


class EngineCoreClient(CoreClient):
    """Starts the engine process, waits until its model is loaded, then forwards requests and receives outputs.

    Args:
        folder: the model folder (the parent read it; the child reads it again by its path).
        config: the engine's settings; pickled to the child, ``fault_injector`` included (it must pickle: a
            module-level class or function).
        sink: receives each message's outputs on the reader thread, as an in-process core's sink does; called once
            more with ``[]`` after ``dead`` is set when the process has ended.

    Raises:
        The child's load error as it was raised there (ModelLoadError, ep's errors, ...), same class and message;
        ModelLoadError when the process ended without saying why; TypeError for a fault injector that cannot pickle.
    """

    def __init__(self, folder: ModelFolder, config: EngineConfig, sink: Sink) -> None:
        self._init_pipe_state(config, sink)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=run_engine_process, name="ortserve-engine", daemon=True,
                                 args=(child_conn, str(folder.path), config, _log_setup()))
        try:
            self._proc.start()
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            self._conn.close()
            if config.fault_injector is None:
                raise
            raise TypeError("EngineConfig.fault_injector must pickle to run in an engine process (a module-level "
                            "class or function, e.g. tests.pacing.ProcessDecodeGate); or set engine_process=False: "
                            f"{exc}") from exc
        finally:
            child_conn.close()  # NOTE(engine): only the child holds its end now, so its exit is EOF here
        self.facts = wait_ready(self._conn, self._proc)
        self._ready(folder, config)

    def _init_pipe_state(self, config: EngineConfig, sink: Sink) -> None:
        """What the pipe's two ends (``_send``, ``_read``) keep, before the pipe exists."""
        self._sink = sink
        self.snapshot = CoreSnapshot(num_slots_free=config.max_batch)
        self.process_cpu_s = 0.0  # the engine process's CPU seconds (all its threads), with each snapshot
        self.dead: BaseException | None = None
        self._lock = threading.Lock()  # one writer at a time on the pipe; `_ended` and `dead` change under it
        self._ended = False  # the reader saw EOF: the process is gone
        self._closing = False  # shutdown was asked for
        self._reader: threading.Thread | None = None

    def _ready(self, folder: ModelFolder, config: EngineConfig) -> None:
        """Once ``facts`` are known: stopped at exit if nobody did, and this process's grammar backend."""
        _LIVE.add(self)
        # NOTE(engine): this process's backend only validates specs (a bad one is a 400 before any output); the
        # engine process compiles each spec again for its matchers.
        self.structured = StructuredOutputBackend(
            folder.tokenizer.hf, self.facts.vocab_size, folder.eos_token_ids,
            compile_timeout_s=config.grammar_compile_timeout_s, cache_size=config.grammar_cache_size)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    # -- the surface AsyncEngine uses -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start receiving outputs (after the owner can take them)."""
        self._reader = threading.Thread(target=self._read, name="ortserve-engine-client", daemon=True)
        self._reader.start()

    def add(self, request: AddRequest, constraints: Sequence[GrammarConstraint | None]) -> None:
        """Send a request to the engine process (``constraints`` stay here: it compiles its own); raises
        EngineDeadError once it has stopped."""
        self._send(request)

    def abort(self, request_ids: Sequence[str], index: int | None = None) -> None:
        try:
            self._send(AbortRequests(list(request_ids), index))
        except EngineDeadError:  # nothing runs there any more
            pass

    def prepare_grammar(self, spec: StructuredOutput) -> None:
        """Let the engine process start compiling ``spec`` while this process compiles it too."""
        try:
            self._send(PrepareGrammar(spec))
        except EngineDeadError:
            pass

    def _ask_shutdown(self) -> None:
        """Send the engine process "shutdown" on this pipe, once (nothing once the engine has ended)."""
        with self._lock:
            asked, self._closing = self._closing, True
            if not asked and not self._ended:
                try:
                    self._conn.send_bytes(dumps(Shutdown()))
                except OSError:
                    pass

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the engine process to stop (everything in flight ends with ABORT), wait for it, and reap it; one that
        has not exited by then is killed."""
        self._ask_shutdown()
        deadline = time.monotonic() + timeout_s + _REAP_S
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(max(0.0, deadline - time.monotonic()))
        self._proc.join(max(0.0, deadline - time.monotonic()))
        if self._proc.is_alive():  # NOTE(engine): it ignores SIGTERM (see run_engine_process)
            log.warning("the engine process did not stop within %.0f s; killing it", timeout_s + _REAP_S)
            self._proc.kill()
            self._proc.join(_REAP_S)
        if self._reader is None:
            self._conn.close()

    @property
    def alive(self) -> bool:
        return not self._ended and self.dead is None

    # -- plumbing ---------------------------------------------------------------------------------------------------

    def _send(self, message: ToCore) -> None:
        data = dumps(message)
        with self._lock:
            if self._ended or self._closing:
                raise EngineDeadError(f"the engine process has stopped: {self.dead!r}" if self._ended else
                                      "the engine is shutting down")
            try:
                # NOTE(engine): the child's reader thread only reads (it never waits on anything else), so this
                # blocks only while a message larger than the pipe's buffer is copied over.
                self._conn.send_bytes(data)
            except OSError as exc:
                raise EngineDeadError(f"the engine process has stopped: {exc!r}") from None

    def _reap(self) -> None:
        """At EOF: reap the process (no zombie, and its exit code is known)."""
        self._proc.join(_REAP_S)
        if self._proc.is_alive():  # the pipe broke but the process lives on (a reader bug): end it
            self._proc.kill()
            self._proc.join(_REAP_S)

    def _eof_reason(self) -> EngineDeadError:
        """Why the engine is gone, when it did not say."""
        if self._closing:
            return EngineDeadError("the engine process has stopped")
        reason = EngineDeadError(f"the engine process has exited ({_exit_text(self._proc)})")
        log.error("%s", reason)
        return reason

    def _read(self) -> None:
        """Reader thread: outputs to the sink, snapshots to ``snapshot``; at EOF, reap the process and fail what is
        left (``dead`` first, then one more call of the sink)."""
        reason: BaseException | None = None
        frames = FrameReader(self._conn.fileno())
        try:
            while True:
                outputs: list = []
                for data in frames.read():  # what one read brought: several steps' outputs go on together
                    message = loads(data)
                    if isinstance(message, StepOutputs):
                        if message.snapshot is not None:
                            self.snapshot, self.process_cpu_s = message.snapshot, message.process_cpu_s
                        outputs += decode_outputs(message.rows)
                    elif isinstance(message, SnapshotUpdate):
                        self.snapshot, self.process_cpu_s = message.snapshot, message.process_cpu_s
                    elif isinstance(message, CoreDied):
                        reason = decode_exception(message.exception)
                if outputs:
                    self._sink(outputs)
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # a bug here: the engine cannot be reached any more
            log.exception("the engine client's reader failed")
            reason = EngineDeadError(f"the engine client's reader failed: {exc!r}")
        self._reap()
        if reason is None:
            reason = self._eof_reason()
        with self._lock:
            self._ended = True
            self.dead = reason
            self._conn.close()
        self._sink([])


def wait_ready(conn: Connection, proc: multiprocessing.process.BaseProcess) -> CoreFacts:
    """The engine process's first message on ``conn``: its facts once the model is loaded.

    Raises:
        The child's load error as it was raised there; ModelLoadError when it ended without saying why.
    """
    try:
        message = loads(conn.recv_bytes())
    except (EOFError, OSError):
        message = None
    if isinstance(message, Ready):
        return message.facts
    proc.join(10)
    conn.close()
    if not isinstance(message, LoadFailed):
        raise ModelLoadError(f"the engine process exited while loading the model ({_exit_text(proc)})")
    exc = decode_exception(message.exception)
    if not isinstance(exc, EngineError):  # a bug or a library's error: keep where it came from
        exc.add_note(f"raised in the engine process:\n{message.traceback}")
    raise exc


def use_engine_process(config: EngineConfig) -> bool:
    """Whether an engine with ``config`` runs its core in a process of its own.

    ``config.engine_process`` when set; automatic (None): on where the model runs on a device (CUDA, AMDGPU/MIGraphX,
    WebGPU, ...), and for ``--provider auto`` where a device EP library is installed (the parent cannot ask which
    device auto takes without loading that library, which must load in the engine process only);
    off on the host CPU.

    NOTE(engine): off on the host CPU (the CPU EP, and OpenVINO, which may run there): measured on 2 shared cores
    no slower and no faster beyond the noise (docs/perf/cpu.md, "The engine in its own process").
    """
    if config.engine_process is not None:
        return config.engine_process
    from ep.profiles import engine_process_default

    default = engine_process_default(config.provider)  # the family's (ep.profiles); None under auto
    if default is not None:
        return default
    from ep.device import find_ep_libraries
    from ep.names import AUTO_ORDER

    return bool(config.ep_library) or bool(find_ep_libraries(AUTO_ORDER))  # (none for the CPU EP)


def _exit_text(proc: multiprocessing.process.BaseProcess) -> str:
    code = proc.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _log_setup() -> tuple[int, str | None]:
    """The root logger's level and format, for the engine process's own logging."""
    root = logging.getLogger()
    fmt = None
    for handler in root.handlers:
        if handler.formatter is not None:
            fmt = handler.formatter._fmt
            break
    return root.getEffectiveLevel(), fmt
