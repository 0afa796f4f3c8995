"""The engine core in a process of its own: loads the model there, runs EngineCore there, and talks to the server's
process over one pipe (engine.core_wire's messages). ``build_core`` is also how AsyncEngine builds an in-process core.

Started by engine.core_client.EngineCoreClient through multiprocessing's spawn context (never fork: the parent has
loaded onnxruntime and runs threads). Tokenizing, detokenizing, stop strings and HTTP stay in the parent; here are
only the session, the KV cache, the scheduler, the samplers and the grammar matchers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine import placement
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_fanout import FanOutbox, SnapshotPacing, start_client_readers
from engine.core_wire import (
    AbortRequests, AddRequest, CoreDied, CoreFacts, FromCore, LoadFailed, PrepareGrammar, Ready, Shutdown,
    SnapshotUpdate, StepOutputs, ToCore, dumps, encode_exception, encode_outputs, loads,
)
from engine.load_priority import LoadPriority
from engine.model_loader import ModelFolder, read_model_folder
from engine.prefix_cache import MIN_REUSE_BATCHED_PROMPTS
from engine.scheduler import Scheduler
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.vocab import check_same_vocabulary
from engine.structured_output import GrammarConstraint, StructuredOutputBackend
from engine.types import CoreOutput, EngineDeadError, FinishReason, ModelLoadError, Sink

log = logging.getLogger(__name__)

# NOTE(engine): the core's counters go to the parent with a step's outputs at most this often (and with every output
# that finishes a request, and when the core goes idle): /metrics and stats() need no more, and a 64-row step's
# message stays the outputs alone.
SNAPSHOT_INTERVAL_S = 0.02


@dataclass
class BuiltCore:
    """An EngineCore (not started) and what it was built from."""

    core: EngineCore
    loaded: placement.Loaded
    structured: StructuredOutputBackend
    speculative_tokens: int

    def facts(self) -> CoreFacts:
        """What the engine's owner needs to know of the loaded model (the engine process's ``Ready`` message)."""
        loaded = self.loaded
        return CoreFacts(max_model_len=loaded.max_model_len, vocab_size=loaded.vocab_size,
                         kv_cache_bytes=loaded.runner.kv.shape.nbytes, placement=loaded.placement,
                         speculative_tokens=self.speculative_tokens, can_verify=loaded.runner.can_verify,
                         buckets=tuple(loaded.runner.buckets), pid=os.getpid(), backend_flags=backend_flags())


def min_prefix_reuse(config: EngineConfig, runner: Any) -> int:
    """The shortest cached prefix a prompt reuses: the configured one, else the runner's own (a prompt chunk through a
    staging row: a chunk), else ``MIN_REUSE_BATCHED_PROMPTS`` where new prompts run together (a reused prefix takes a
    prompt out of that run), else any match."""
    if config.min_prefix_reuse is not None:
        return config.min_prefix_reuse
    if runner.min_prefix_reuse is not None:
        return runner.min_prefix_reuse
    return MIN_REUSE_BATCHED_PROMPTS if runner.can_batch_prompts else 1


def max_prefills_per_step(config: EngineConfig, runner: Any) -> int:
    """The most requests whose prompt chunks run in one step: the configured number, else the runner's."""
    if config.max_prefills_per_step is not None:
        return config.max_prefills_per_step
    return runner.max_prefills_per_step


def build_core(folder: ModelFolder, config: EngineConfig, sink: Sink,
               between_steps: Callable[[bool], None] | None = None) -> BuiltCore:
    """Sessions, KV cache and runner for the device (``placement.load``), the scheduler, the grammar backend and the
    core over them: the same in an engine process and in the server's own.

    Raises:
        ModelLoadError: the model can't be served on this device (ep/'s own errors propagate unchanged).
    """
    loaded = placement.load(folder, config)
    runner = loaded.runner
    # NOTE(engine): a draft check is a run of S > 1 tokens in one row; whole-buffer mode runs every row at
    # S = 1 (GroupQueryAttention refuses S > 1 with a past at batch > 1), so no speculation there.
    speculative_tokens = config.speculative_tokens if runner.can_verify else 0
    draft_model = load_draft_model(folder, config, loaded) if config.draft_model and runner.can_verify else None
    scheduler = Scheduler(config.max_batch, config.max_queue + config.max_batch, runner.prefill_chunk,
                          prefix_caching=config.prefix_caching, can_copy=runner.can_copy,
                          speculative_tokens=speculative_tokens,
                          speculative_max_batch=config.speculative_max_batch,
                          low_slots=len(runner.buckets) > 1, max_prefills=max_prefills_per_step(config, runner),
                          min_prefix_reuse=min_prefix_reuse(config, runner),
                          prompt_budget=placement.batched_prompt_tokens(config, runner),
                          batched_prompt_len=runner.max_batched_prompt + 1 if runner.can_batch_prompts else 0)
    # NOTE(engine): grammars compile in the backend's worker threads (its tokenizer is built on first use),
    # never on the core thread; the core only fills masks and advances constraints.
    structured = StructuredOutputBackend(
        folder.tokenizer.hf, loaded.vocab_size, folder.eos_token_ids,
        compile_timeout_s=config.grammar_compile_timeout_s, cache_size=config.grammar_cache_size)
    core = EngineCore(runner, scheduler, sink, seed=config.seed, fault_injector=config.fault_injector,
                      structured=structured, between_steps=between_steps, step_trace=config.step_trace,
                      draft_model=draft_model)
    if draft_model is not None:
        scheduler.use_draft_model(config.draft_max)
        draft_model.cost = scheduler.check_cost
    return BuiltCore(core, loaded, structured, speculative_tokens)


def load_draft_model(folder: ModelFolder, config: EngineConfig, loaded: placement.Loaded) -> DraftModelProposer:
    """The draft model of ``config.draft_model`` on the target's device, with KV rows of its own (one per slot, the
    target's context length) and its proposer.

    Raises:
        ModelLoadError: its vocabulary differs from the target's (the first difference named), or its runner
            cannot run a row on its own (opaque whole-buffer KV).
    """
    draft_folder = read_model_folder(Path(config.draft_model))
    check_same_vocabulary(folder.path, draft_folder.path)
    # NOTE(engine): the draft's thread pool must not spin against the target's after its runs (config.stop_spinning)
    draft_config = dataclasses.replace(config, max_model_len=loaded.max_model_len, speculative_tokens=0,
                                       draft_model=None, batched_prompts=False, graph_capture=False,
                                       stop_spinning=config.stop_spinning is not False)
    draft = placement.load(draft_folder, draft_config)
    if draft.runner.whole_buffer or not draft.runner.can_verify:
        raise ModelLoadError(f"the draft model {draft_folder.model_name} needs KV rows of its own on this device "
                             f"({draft.placement.runner}): serve without --draft-model")
    log.info("draft model %s: %d KV rows of %d tokens, %.0f MiB", draft_folder.model_name, draft.runner.num_slots,
             draft.max_model_len, draft.runner.kv.shape.nbytes / 2**20)
    return DraftModelProposer(draft.runner, loaded.vocab_size, p_min=config.draft_p_min, min_tokens=config.draft_min)


def backend_flags() -> dict[str, str | None]:
    """The backend env flags (ep.flags.REGISTRY and their companions) as this process sees them."""
    from ep.flags import REGISTRY

    return {name: os.environ.get(name) for flag in REGISTRY for name in (flag.name, *flag.passthrough)}


# -- the engine process ---------------------------------------------------------------------------------------------


def run_engine_process(conn: Connection, folder_path: str, config: EngineConfig,
                       log_setup: tuple[int, str | None], clients: list[Connection] | None = None) -> None:
    """The engine process's main (a multiprocessing target): load, report, serve the pipe until shutdown or EOF.

    ``clients``: one pipe per API process of a server with several (engine.core_attach, engine.core_fanout); then
    ``conn`` is the parent's control pipe (``Ready``, ``Shutdown``) and requests come over the client pipes.

    NOTE(engine): SIGINT and SIGTERM are ignored here: Ctrl-C reaches the whole process group and a service
    manager may signal every process of the service, but only the parent decides when the engine stops (it drains
    streams first, then sends "shutdown"). A parent that dies closes the pipe, and the engine ends on that EOF.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level, fmt = log_setup
    logging.basicConfig(level=level, **({"format": fmt} if fmt else {}))
    EngineProcess(conn, clients).main(folder_path, config)


class EngineProcess:
    """The child's side of the pipe: the reader thread feeds the core's inbox, the core's sink sends outputs (with
    ``clients``, a FanOutbox splits them per client and one reader per client feeds the core)."""

    def __init__(self, conn: Connection, clients: list[Connection] | None = None) -> None:
        self.conn = conn
        self.clients = clients
        self.outbox: Any = _Outbox(conn) if clients is None else FanOutbox(conn, clients, SNAPSHOT_INTERVAL_S)
        self.feed: _OrderedFeed | None = None
        self.core: EngineCore | None = None

    def main(self, folder_path: str, config: EngineConfig) -> None:
        # NOTE(engine): reading starts before loading, so a parent that dies during a long load ends this process
        # at once (EOF) instead of leaving it to finish loading for nobody.
        reader = threading.Thread(target=self._read, name="ortserve-engine-reader", daemon=True)
        reader.start()
        # NOTE(engine): a hub loads beside other models' streams: the load runs at a lower CPU priority
        # (config.load_nice), and every thread that serves afterwards runs at the process's own (LoadPriority)
        priority = LoadPriority(config.load_nice)
        try:
            folder = priority.call(lambda: read_model_folder(Path(folder_path), config.chat_template),
                                   starts_threads=False)
            built = priority.call(lambda: build_core(folder, config, self.outbox,
                                                     between_steps=self.outbox.between_steps), starts_threads=True)
        except BaseException as exc:  # noqa: BLE001 - every load failure goes to the parent, as it was raised
            import traceback

            self.outbox.send(LoadFailed(encode_exception(exc), traceback.format_exc()))
            return
        finally:
            priority.restore()
        core = self.core = self.outbox.core = built.core
        facts = built.facts()
        self.feed = _OrderedFeed(core, built.structured, folder.eos_token_ids, facts.max_model_len, self.outbox)
        # NOTE(engine): as the server does after loading (server.app._tune_interpreter): what lives as long as the
        # process goes to the permanent generation, so full collections stop scanning it.
        gc.collect()
        gc.freeze()
        self.outbox.send(Ready(facts))  # before the core can send anything
        if self.clients is not None:
            start_client_readers(self.clients, self.feed, self.outbox)
        core.start()
        core.join()
        if core.dead is not None:
            self.outbox.send(CoreDied(encode_exception(EngineDeadError(f"the engine core has stopped: {core.dead!r}"))))
        built.structured.shutdown()
        self.conn.close()

    def _read(self) -> None:
        """Reader thread: every message from the parent, in order, to the feed; EOF or "shutdown" stops the core."""
        while True:
            try:
                message = loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                if self.core is None:  # the parent went away while this process was loading
                    log.warning("the server process has gone; the engine process exits")
                    os._exit(0)
                self._stop()
                return
            if isinstance(message, Shutdown):
                self._stop()
                return
            if self.feed is not None and isinstance(message, (AddRequest, AbortRequests, PrepareGrammar)):
                self.feed.put(message)

    def _stop(self) -> None:
        if self.feed is not None:
            self.feed.close()
        if self.core is not None:
            self.core.shutdown(0)  # the main thread joins it


class _Outbox(SnapshotPacing):
    """The core's sink in the engine process: one "out" message per call (a decode run's outputs, a prompt's first
    token), the core's snapshot with it when due; and "snap" messages between steps when the core idles or no output
    carried one for ``SNAPSHOT_INTERVAL_S`` (SnapshotPacing)."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(SNAPSHOT_INTERVAL_S)
        self.conn = conn
        self.core: EngineCore | None = None
        self._lock = threading.Lock()  # the core thread and the reader (refused adds) both send
        self.broken = False

    def __call__(self, outputs: list[CoreOutput]) -> None:
        snapshot = self._step_snapshot(outputs)
        self.send(StepOutputs(encode_outputs(outputs), snapshot, time.process_time() if snapshot is not None else None),
                  snapshot)

    def between_steps(self, idle: bool) -> None:
        snapshot = self._idle_snapshot(idle)
        if snapshot is not None:
            self.send(SnapshotUpdate(snapshot, time.process_time()), snapshot)

    def send(self, message: FromCore, snapshot: Any = None) -> None:
        data = dumps(message)
        with self._lock:
            if self.broken:
                return
            if snapshot is not None:
                self._sent_snapshot, self._sent_s = snapshot, time.monotonic()
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):  # the parent is gone: stop (the reader sees EOF as well)
                self.broken = True
                if self.core is not None:
                    self.core.shutdown(0)


class _OrderedFeed:
    """Adds and aborts reach the core in the order the parent sent them.

    NOTE(engine): a structured request's grammar is compiled here too (the parent compiled it to validate it; the
    compiled matcher does not cross processes). The parent's "grammar" message starts that compile while the
    parent's own runs, so it is usually done when the add comes. If not, the add and everything after it are held
    until it is (a compile-worker callback releases them): the reader never waits, so the parent's writes never
    block on a full pipe.
    """

    def __init__(self, core: EngineCore, structured: StructuredOutputBackend, eos_token_ids: frozenset[int],
                 max_model_len: int, sink: Sink) -> None:
        self.core, self.structured, self.sink = core, structured, sink
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self._held: collections.deque[AddRequest | AbortRequests] = collections.deque()
        self._lock = threading.RLock()  # re-entered when a compile is done by the time its callback is added
        self._waiting: concurrent.futures.Future | None = None
        self._closed = False

    def put(self, message: ToCore) -> None:
        if isinstance(message, PrepareGrammar):
            self.structured.compile_future(message.spec)  # start compiling; nothing to deliver
            return
        with self._lock:
            self._held.append(message)
            self._release()

    def close(self) -> None:
        """Shutdown: held adds end with ABORT (the core never saw them)."""
        with self._lock:
            self._closed = True
            held, self._held = list(self._held), collections.deque()
        ended = [CoreOutput(m.request_id, (), FinishReason.ABORT, seq=m.seq, index=i)
                 for m in held if isinstance(m, AddRequest) for i in range(m.params.n)]
        if ended:
            self.sink(ended)

    def _release(self, _done: Any = None) -> None:
        with self._lock:
            while self._held and not self._closed:
                message = self._held[0]
                pending = self._compiling(message)
                if pending is not None:
                    if pending is not self._waiting:
                        self._waiting = pending
                        pending.add_done_callback(self._release)
                    return
                self._held.popleft()
                self._deliver(message)

    def _compiling(self, message: AddRequest | AbortRequests) -> concurrent.futures.Future | None:
        if not isinstance(message, AddRequest) or message.params.structured is None:
            return None
        future = self.structured.compile_future(message.params.structured)
        return None if future.done() else future

    def _deliver(self, message: AddRequest | AbortRequests) -> None:
        if isinstance(message, AbortRequests):
            self.core.abort(message.request_ids, message.index)
            return
        request_id, params, seq = message.request_id, message.params, message.seq
        try:
            constraints: Sequence[GrammarConstraint | None] = [None] * params.n
            if params.structured is not None:
                constraints = [self.structured.constraint_sync(params.structured) for _ in range(params.n)]
        except Exception as exc:  # the parent compiled it; still, one request only
            log.exception("request %s: its grammar did not compile in the engine process", request_id)
            self.sink([CoreOutput(request_id, (), FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}", seq=seq,
                                  exception=exc)])
            return
        try:
            self.core.add(message.to_request(self.eos_token_ids, self.max_model_len, constraints))
        except EngineDeadError:  # the core has ended; the parent learns it from the pipe
            pass

