"""``--api-server-count N`` (N > 1): N API processes in front of one engine process, as vLLM's run_multi_api_server.

The parent (``ortserve serve``) binds the listening sockets (``bind_sockets``), starts the engine process
(engine.core_attach.SharedEngineProcess) and waits for its model, then spawns N API processes that each serve one
with uvicorn and drive the engine over a pipe of their own (engine.core_attach.AttachedCoreClient). Request admission (HTTP,
validation, the chat template, tokenizing, the pipe) is spread over N event loops; the engine runs one batch.

The parent supervises: SIGTERM/SIGINT -> SIGTERM to every API process (each drains its streams, as one server
does), then the engine process stops. An API process or the engine process that ends on its own stops the whole
server (exit code 1, logged); none is restarted. Imports the engine lazily (never onnxruntime at import).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

from server.settings import Settings

logger = logging.getLogger("ortserve")

# NOTE(server): the response header that names the API process that answered (only with --api-server-count > 1)
API_SERVER_HEADER = "ortserve-api-server"
# how long an API process's load waits for the others to serve the socket and load before it reports ready anyway
_ALL_SERVING_TIMEOUT_S = 60.0
# the slots of the shared counters (``group``): API processes whose uvicorn serves the socket, whose engine loaded
_SERVING, _LOADED = 0, 1
# what the parent allows an API process beyond its uvicorn's graceful timeout before it kills it
_STOP_SLACK_S = 10.0


def refusal(settings: Settings) -> str | None:
    """Why ``settings`` cannot run with ``api_server_count`` > 1 (None: they can, or it is 1).

    Refused: several models (each hub model has an engine process of its own, which the API processes cannot share
    yet); an in-process engine (--no-engine-process: there is nothing to share); embeddings (--embedding-model,
    --embeddings: they run in the API process's own engine, and would load once per API process).
    """
    if settings.api_server_count == 1:
        return None
    flag = f"--api-server-count {settings.api_server_count}"
    if settings.models or settings.models_dir:
        return (f"{flag} serves one chat model: several models (--model repeated, --models, --models-dir, a config "
                "file's models list) need --api-server-count 1")
    if settings.engine_process is False:
        return f"{flag} shares one engine process between the API processes: it cannot run with --no-engine-process"
    if settings.embedding_model or settings.embeddings:
        return (f"{flag} cannot serve embeddings (--embedding-model, --embeddings): they run in each API process "
                "and would load once per process; serve them from a server with --api-server-count 1")
    return None


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """The sockets the API processes listen on, bound here (each uvicorn listens on its own): ``count`` sockets on
    one port with SO_REUSEPORT on Linux, else one socket they all share. Raises OSError (e.g. the port is taken).

    NOTE(server): with one shared socket a burst of connections goes mostly to one process: every process's loop
    wakes on the socket, and asyncio's accept loop takes every pending connection at once, so the first awake takes
    the burst (measured: 5 of 6 concurrent requests to one process). With SO_REUSEPORT the kernel hashes each
    connection to one of the sockets, so a burst spreads evenly whoever is awake. (Another process of the same user
    that listens on the port with SO_REUSEPORT would share it: uvicorn's own sockets do not set it.)
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reuse_port = sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")
    sockets: list[socket.socket] = []
    try:
        for _ in range(count if reuse_port else 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # port 0: the others join the port the first one got
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets * count if len(sockets) == 1 else sockets


def serve_api_servers(settings: Settings, graceful_timeout_s: float) -> int:
    """The parent of N API processes and one engine process: start them, supervise them, stop them; the exit code.

    Args:
        settings: resolved settings (``model`` is the model folder), ``api_server_count`` > 1.
        graceful_timeout_s: each API process's uvicorn graceful-shutdown timeout.
    """
    from engine.core_attach import SharedEngineProcess
    from engine.core_client import _log_setup
    from server.app import engine_config_from

    count = settings.api_server_count
    try:
        sockets = bind_sockets(settings.host, settings.port, count)
    except OSError as exc:
        print(f"ortserve serve: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    try:
        # (settings.draft_model: resolved by __main__, as settings.model)
        engine = SharedEngineProcess(settings.model, replace(engine_config_from(settings, settings.draft_model),
                                                             engine_process=True), count)
    except Exception as exc:  # noqa: BLE001 - the engine's load error, as one server reports it
        print(f"ortserve serve: the model in {settings.model} cannot be served: {exc}", file=sys.stderr)
        for sock in set(sockets):
            sock.close()
        return 1
    ctx = multiprocessing.get_context("spawn")
    group = ctx.Array("i", 2)  # [_SERVING, _LOADED]: API processes that serve the socket, that loaded the engine
    procs = [ctx.Process(target=run_api_server, name=f"ortserve-api-{i}", daemon=True,
                         args=(settings, sockets[i], engine.client_conns[i], i, group, graceful_timeout_s,
                               _log_setup()))
             for i in range(count)]
    for proc in procs:
        proc.start()
    engine.release_client_conns()  # NOTE(server): only the API processes hold them now: their exit is EOF there
    for sock in set(sockets):
        sock.close()
    logger.info("serving %s on http://%s:%d/v1: %d API processes (pids %s), engine process %s", settings.model,
                settings.host, settings.port, count, ", ".join(str(p.pid) for p in procs), engine.pid)
    code = _supervise(procs, engine)
    _stop(procs, engine, graceful_timeout_s + _STOP_SLACK_S, settings.shutdown_grace_s)
    return code


def _supervise(procs: list[Any], engine: Any) -> int:
    """Wait for SIGTERM/SIGINT (0) or for a process to end on its own (1, logged)."""
    signals: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    previous_fd = signal.set_wakeup_fd(wake_w)
    handlers = {sig: signal.signal(sig, lambda signum, _frame: signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not signals:
            ready = wait([wake_r, engine.sentinel, *(p.sentinel for p in procs)])
            if wake_r in ready:
                os.read(wake_r, 512)  # a signal's wake-up byte; its handler has recorded it
            if signals:
                break
            # NOTE(server): a sentinel is readable once the process has closed its files, a moment before it can be
            # reaped: join (not is_alive) to learn its exit code
            if engine.sentinel in ready:
                engine.proc.join(5)
                logger.error("the engine process has exited (exit code %s); stopping the server", engine.proc.exitcode)
                return 1
            for index, proc in enumerate(procs):
                if proc.sentinel in ready:
                    proc.join(5)
                    logger.error("API process %d (pid %s) has exited (exit code %s); stopping the server", index,
                                 proc.pid, proc.exitcode)
                    return 1
        logger.info("%s: stopping the API processes, then the engine", signal.Signals(signals[0]).name)
        return 0
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.close(wake_r)
        os.close(wake_w)


def _stop(procs: list[Any], engine: Any, timeout_s: float, engine_timeout_s: float) -> None:
    """SIGTERM every API process (each drains as one server does), wait, kill what is left; then the engine."""
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for index, proc in enumerate(procs):
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.warning("API process %d did not stop within %.0f s; killing it", index, timeout_s)
            proc.kill()
            proc.join(5)
    engine.shutdown(engine_timeout_s)


# -- one API process ---------------------------------------------------------------------------------------------------


def run_api_server(settings: Settings, sock: socket.socket, conn: Connection, index: int, group: Any,
                   graceful_timeout_s: float, log_setup: tuple[int, str | None]) -> None:
    """An API process's main (a spawn target): the app over the shared engine, uvicorn on the shared socket."""
    level, fmt = log_setup
    logging.basicConfig(level=level, **({"format": fmt} if fmt else {}))
    from server.http.memory import use_one_arena

    use_one_arena()
    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.core_attach import make_attached_factory
    from server.app import create_app, engine_config_from
    from server.http.timeouts import with_header_timeout

    count = settings.api_server_count
    factory = make_attached_factory(conn, index, count)

    def load(model_settings: Settings) -> Any:
        return AsyncEngine.from_model_dir(model_settings.model, engine_config_from(model_settings),
                                          core_factory=factory)

    def all_ready() -> None:
        # NOTE(server): ready (/health 200) once every API process serves the socket and has loaded: the first
        # requests spread over all of them instead of going to whichever came up first, and none lands on a
        # process whose load is still under way (a 503 "still loading" after another's /health said 200)
        with group.get_lock():
            group[_LOADED] += 1
        deadline = time.monotonic() + _ALL_SERVING_TIMEOUT_S
        while min(group[_SERVING], group[_LOADED]) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        if min(group[_SERVING], group[_LOADED]) < count:
            logger.warning("API process %d: of %d API processes, %d serve and %d loaded after %.0f s; ready anyway",
                           index, count, group[_SERVING], group[_LOADED], _ALL_SERVING_TIMEOUT_S)

    app = create_app(settings, loader=load)
    app.add_middleware(ApiServerHeader, index=index)
    config = uvicorn.Config(app, log_level=settings.log_level, http=with_header_timeout(settings.header_timeout_s),
                            timeout_graceful_shutdown=graceful_timeout_s)

    class CountingServer(uvicorn.Server):
        """Counts itself in ``group[_SERVING]`` once its socket serves."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                with group.get_lock():
                    group[_SERVING] += 1

    server = CountingServer(config)
    state = app.state.ortserve
    state.before_ready = all_ready

    def stop_on_load_failure(_message: str) -> None:
        server.should_exit = True

    state.on_load_failed = stop_on_load_failure
    threading.Thread(target=_exit_with_parent, args=(server,), name="ortserve-parent-watch", daemon=True).start()
    server.run(sockets=[sock])
    if state.status == "failed" or state.load_error:
        logger.error("API process %d: the engine cannot be served: %s", index, state.load_error)
        sys.exit(1)


def _exit_with_parent(server: Any) -> None:
    """Stop serving (gracefully) once the parent has gone: nobody would stop this process otherwise."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        server.should_exit = True


class ApiServerHeader:
    """Pure ASGI middleware: every HTTP response says which API process answered (``ortserve-api-server: i``)."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self.header = (API_SERVER_HEADER.encode(), str(index).encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)
