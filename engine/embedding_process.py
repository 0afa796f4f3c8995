"""An embedding engine in a process of its own (the model hub's embedding models, issue 37: one engine per loaded
model, each in a process that owns its device session), beside EmbeddingEngine's in-process thread.

The child runs an EmbeddingEngine (its session, its worker thread, its batching) and answers ``embed`` messages
over one pipe; the parent keeps the tokenizer, the input checks and the queue bound (EmbeddingInputs), so only
checked token ids go over and pooled float32 vectors come back (a 384-dimension vector is 1.5 KB). Started through
multiprocessing's spawn context, as engine.core_client starts a chat engine's process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from engine.embedding import EmbeddingConfig, EmbeddingEngine, EmbeddingInputs, EmbeddingStats, read_embedding_folder
from engine.types import EngineDeadError, EngineOverloadedError, ModelLoadError

log = logging.getLogger(__name__)

READY, FAILED, EMBED, OUT, SHUTDOWN = "ready", "failed", "embed", "out", "shutdown"
_REAP_S = 10.0


def run_embedding_process(conn: Connection, path: str, config: EmbeddingConfig, log_level: int) -> None:
    """The child's main: load, report READY (or FAILED with the error), answer EMBED until SHUTDOWN or EOF.

    NOTE(engine): SIGINT and SIGTERM are ignored, as in the chat engine's process (engine.core_process): the parent
    decides when it stops; a parent that dies closes the pipe and the child ends on that EOF.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level)
    try:
        engine = EmbeddingEngine.from_model_dir(path, config)
    except BaseException as exc:  # noqa: BLE001 - every load failure goes to the parent, as it was raised
        conn.send((FAILED, exc))
        return
    conn.send((READY, os.getpid()))
    send_lock = threading.Lock()

    def answer(job_id: int, future: concurrent.futures.Future) -> None:
        exc = future.exception()
        message = (OUT, job_id, None if exc else future.result(), exc, asdict(engine.stats()))
        with send_lock:
            try:
                conn.send(message)
            except OSError:  # the parent has gone
                pass

    try:
        while True:
            message = conn.recv()
            if message[0] == SHUTDOWN:
                break
            _, job_id, token_ids = message
            try:
                engine.submit(token_ids).add_done_callback(lambda f, job_id=job_id: answer(job_id, f))
            except Exception as exc:  # noqa: BLE001 - the job's error (overload, a dead worker) goes back
                with send_lock:
                    conn.send((OUT, job_id, None, exc, asdict(engine.stats())))
    except (EOFError, OSError):
        pass
    finally:
        engine.shutdown()


class EmbeddingProcessClient(EmbeddingInputs):
    """EmbeddingEngine's surface (facts, tokenize, check, submit, embed, stats, shutdown) over an engine process.

    Raises (constructor): the child's load error as it was raised there; ModelLoadError when it exited without one.
    """

    def __init__(self, path: str | Path, config: EmbeddingConfig) -> None:
        self.folder = read_embedding_folder(path)  # the tokenizer and the facts, here
        self.config = config
        self.pooling = config.pooling or self.folder.pooling
        self.tokenizer = self.folder.tokenizer
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._stats = EmbeddingStats(num_requests=0)
        self.dead: BaseException | None = None
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=run_embedding_process, name="ortserve-embed", daemon=True,
                                 args=(child, str(path), config, logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        child.close()  # NOTE(engine): only the child holds its end now, so its exit is EOF here
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            kind, value = FAILED, None
        if kind != READY:
            self._proc.join(_REAP_S)
            self._conn.close()
            raise value if isinstance(value, BaseException) else ModelLoadError(
                f"the embedding engine process of {self.folder.model_name} exited while loading "
                f"(exit code {self._proc.exitcode})")
        self.engine_pid: int = value
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"ortserve-embed-client-{self.folder.model_name}")
        self._reader.start()
        log.info("embedding engine %s ready in process %d", self.folder.model_name, self.engine_pid)

    @property
    def is_running(self) -> bool:
        return self.dead is None and self._proc.is_alive()

    def submit(self, token_ids: Sequence[Sequence[int]]) -> concurrent.futures.Future:
        """Send checked inputs to the engine process; the future gives one float32 array per input.

        Raises:
            EngineOverloadedError: ``max_queue`` requests are already waiting or running.
            EngineDeadError: the engine process has ended.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(f"the embedding engine of {self.model_name} has stopped: {self.dead}")
            if len(self._pending) >= self.config.max_queue:
                raise EngineOverloadedError(
                    f"The embedding queue of {self.model_name} is full ({self.config.max_queue} requests); retry "
                    f"later.", retry_after_s=1.0)
            job_id = next(self._ids)
            self._pending[job_id] = future
            try:
                self._conn.send((EMBED, job_id, [list(ids) for ids in token_ids]))
            except OSError as exc:
                del self._pending[job_id]
                raise EngineDeadError(f"the embedding engine of {self.model_name} has stopped: {exc}") from exc
        return future

    async def embed(self, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """``submit`` awaited on the event loop (a cancelled await drops the answer)."""
        return await asyncio.wrap_future(self.submit(token_ids))

    def embed_sync(self, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return self.submit(token_ids).result()

    def stats(self) -> EmbeddingStats:
        """The child's counters as of its last answer; the requests in flight counted here."""
        with self._lock:
            return EmbeddingStats(**{**asdict(self._stats), "num_requests": len(self._pending)})

    def shutdown(self) -> None:
        """Ask the engine process to stop, wait for it, reap it (killed if it has not ended in time)."""
        with self._lock:
            try:
                self._conn.send((SHUTDOWN,))
            except OSError:
                pass
        self._proc.join(60)
        if self._proc.is_alive():
            log.warning("the embedding engine process of %s did not stop; killing it", self.model_name)
            self._proc.kill()
            self._proc.join(_REAP_S)
        self._reader.join(_REAP_S)

    def _read(self) -> None:
        """Answers to their futures; at EOF (the process ended, killed or asked to) every pending one fails."""
        try:
            while True:
                _, job_id, vectors, exc, stats = self._conn.recv()
                with self._lock:
                    future = self._pending.pop(job_id, None)
                    self._stats = EmbeddingStats(**stats)
                if future is None:
                    continue
                try:
                    if exc is not None:
                        future.set_exception(exc)
                    else:
                        future.set_result(vectors)
                except concurrent.futures.InvalidStateError:  # cancelled: its request has gone
                    pass
        except (EOFError, OSError):
            pass
        with self._lock:
            self.dead = self.dead or EngineDeadError(
                f"the embedding engine process of {self.model_name} has ended (exit code {self._proc.exitcode})")
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            try:
                future.set_exception(self.dead)
            except concurrent.futures.InvalidStateError:
                pass
        self._conn.close()
