"""One engine process shared by several API processes (``--api-server-count``, as vLLM's ``--api-server-count``):
``SharedEngineProcess`` starts it in the parent with one pipe per API process; each API process's AsyncEngine drives
it through an ``AttachedCoreClient`` on its own pipe.

The engine process's side is engine.core_fanout (requests from every pipe into one core, outputs split per client
by ``seq % num_clients``). The API processes never start or stop the engine process: the parent does, after they
have all ended. Sessions are created only in the engine process.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from engine.config import EngineConfig
from engine.core_client import _REAP_S, EngineCoreClient, _log_setup, wait_ready
from engine.core_process import run_engine_process
from engine.core_wire import CoreFacts, Shutdown, dumps
from engine.model_loader import ModelFolder
from engine.types import EngineDeadError, Sink

log = logging.getLogger(__name__)


class SharedEngineProcess:
    """The engine process of a server with several API processes, started (and stopped) by the parent.

    Args:
        folder_path: the model folder.
        config: the engine's settings (``engine_process`` is implied).
        num_clients: API processes; ``client_conns[i]`` is API process i's end of its pipe: give each to its process,
            then call ``release_client_conns`` so that only they hold them (an API process's exit is then EOF there).

    Raises:
        The engine process's load error as it was raised there (see engine.core_client.wait_ready).
    """

    def __init__(self, folder_path: str | Path, config: EngineConfig, num_clients: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, control_child = ctx.Pipe()
        pairs = [ctx.Pipe() for _ in range(num_clients)]
        self.client_conns: list[Connection] = [ours for ours, _ in pairs]
        self.proc = ctx.Process(target=run_engine_process, name="ortserve-engine", daemon=True,
                                args=(control_child, str(folder_path), config, _log_setup(),
                                      [theirs for _, theirs in pairs]))
        try:
            self.proc.start()
        finally:  # NOTE(engine): only the engine process holds its ends now, so its exit is EOF on ours
            control_child.close()
            for _, theirs in pairs:
                theirs.close()
        try:
            self.facts: CoreFacts = wait_ready(self._conn, self.proc)
        except BaseException:
            self.release_client_conns()
            raise
        self._stopped = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def sentinel(self) -> int:
        """Ready to read (multiprocessing.connection.wait) once the engine process has ended."""
        return self.proc.sentinel

    def release_client_conns(self) -> None:
        """Close this process's copies of the client pipes (after the API processes got theirs)."""
        for conn in self.client_conns:
            conn.close()
        self.client_conns = []

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine process (what is still in flight ends with ABORT) and reap it; killed if it has not
        exited within ``timeout_s`` + a few seconds. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._conn.send_bytes(dumps(Shutdown()))
        except OSError:
            pass
        self.proc.join(timeout_s + _REAP_S)
        if self.proc.is_alive():  # NOTE(engine): it ignores SIGTERM (engine.core_process.run_engine_process)
            log.warning("the engine process did not stop within %.0f s; killing it", timeout_s + _REAP_S)
            self.proc.kill()
            self.proc.join(_REAP_S)
        self._conn.close()


class AttachedCoreClient(EngineCoreClient):
    """An API process's end of a SharedEngineProcess: EngineCoreClient's pipe protocol without the process.

    Adds, aborts and grammar hints go over this API process's own pipe; the engine process sends back only the
    outputs of this client's requests (``seq % num_clients == client_index``), and every snapshot. ``shutdown``
    detaches (the engine goes on for the other API processes); the parent stops the engine process.

    Args:
        folder, config, sink: as EngineCoreClient's.
        conn: this API process's end of its pipe (SharedEngineProcess.client_conns[client_index]).
        client_index, num_clients: which client this is, of how many.
    """

    def __init__(self, folder: ModelFolder, config: EngineConfig, sink: Sink, *, conn: Connection,
                 client_index: int, num_clients: int) -> None:
        self._init_pipe_state(config, sink)
        self.client_index, self.num_clients = client_index, num_clients
        self._conn = conn
        self._proc = None
        # NOTE(engine): the engine process sent Ready to every client before the parent started this process
        self.facts = wait_ready(conn, _NoProcess())
        self._ready(folder, config)

    @property
    def pid(self) -> int | None:
        return self.facts.pid

    @property
    def exitcode(self) -> int | None:
        return None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Detach from the engine process: it closes this pipe (EOF to the reader); idempotent."""
        self._ask_shutdown()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout_s + _REAP_S)
        if self._reader is None:
            self._conn.close()

    def _reap(self) -> None:  # nothing to reap: the parent owns the engine process
        pass

    def _eof_reason(self) -> EngineDeadError:
        if self._closing:
            return EngineDeadError("the engine process has stopped")
        reason = EngineDeadError("the shared engine process has stopped (see the server's log)")
        log.error("%s", reason)
        return reason


class _NoProcess:
    """What wait_ready needs of a process where this one has none to join (an attached client)."""

    exitcode = None
    pid = None

    def join(self, timeout: float | None = None) -> None:
        pass


def make_attached_factory(conn: Connection, client_index: int,
                          num_clients: int) -> Callable[[ModelFolder, EngineConfig, Sink], AttachedCoreClient]:
    """AsyncEngine's ``core_factory`` for API process ``client_index`` of ``num_clients`` on ``conn``."""

    def factory(folder: ModelFolder, config: EngineConfig, sink: Sink) -> AttachedCoreClient:
        return AttachedCoreClient(folder, config, sink, conn=conn, client_index=client_index, num_clients=num_clients)

    return factory
