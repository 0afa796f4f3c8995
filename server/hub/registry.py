"""ModelRegistry: the models of one server (the hub), routed by `model`; loads on first request, unloads when idle,
keeps the loaded models within a memory budget.

Every engine below the registry is the one-model engine it always was (a chat model's in a process of its own when
the server has several); nothing below here learns that there are several. A one-model server is the registry's
degenerate case: one pinned entry, loaded before the server reports ready, never unloaded.

Requests hold a lease on their model from routing until their response has been sent (LeaseMiddleware releases it),
so a model with a running stream is never unloaded or evicted. Loading runs in a worker thread (and a chat model's
session in its engine process), never on the event loop. No onnxruntime import.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from server.errors import EngineNotReadyError, ModelCannotError, ModelNotFoundError
from server.hub.catalog import CatalogModel, default_memory_budget, estimate_bytes, format_bytes, kind_of_folder, \
    parse_bytes, resolve_kind
from server.hub.tokenizers import hold_listed, hold_loaded
from server.settings import Settings

logger = logging.getLogger("ortserve.hub")

UNLOADED, LOADING, READY, FAILED = "unloaded", "loading", "ready", "failed"
OLLAMA_TAG = ":latest"
# NOTE(hub): how soon a request whose model is loading may try again, when the load outlasts --load-timeout-s
LOADING_RETRY_AFTER_S = 5


class MemoryBudgetError(EngineNotReadyError):
    """No room for a model: the loaded ones are busy (503 with Retry-After; a stream is never ended for room)."""

    def __init__(self, name: str, need: int, used: int, budget: int, busy: list[str]) -> None:
        busy_text = ", ".join(busy) or "none"
        super().__init__(
            f"Not enough memory to load the model {name!r}: it needs {format_bytes(need)}, and "
            f"{format_bytes(used)} of the {format_bytes(budget)} memory budget is held by models with requests "
            f"running ({busy_text}); retry when one is idle.",
            code="memory_budget", headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})


class ModelEntry:
    """One model of the catalog and what is loaded of it."""

    def __init__(self, model: CatalogModel) -> None:
        self.model = model
        self.status = UNLOADED
        self.engine: Any = None  # EngineClient of a chat model
        self.embedder: Any = None  # EmbedderClient of an embedding model (or a chat model's own, --embeddings)
        self.owned = True  # False: given to create_app; never shut down here
        self.load_error: str | None = None
        self.task: asyncio.Task | None = None
        self.leases = 0  # requests between routing and their response's end
        self.last_used_s = time.monotonic()
        self.keep_alive_s: float | None = None  # the last request's keep_alive/ttl (None: the model's default)
        self.estimate_bytes = 0
        self.load_time_s: float | None = None
        self.loaded_at: float | None = None  # wall clock
        self.num_loads = 0

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def kind(self) -> str | None:
        return self.model.kind

    @property
    def alive(self) -> bool:
        """Loaded and its engines still running (a killed engine process is not)."""
        return self.status == READY and all(getattr(e, "is_running", True) for e in (self.engine, self.embedder)
                                            if e is not None)

    @property
    def pid(self) -> int | None:
        """Its engine process's (a chat model's, else an embedding model's own), None where it runs here."""
        return next((pid for e in (self.engine, self.embedder) if (pid := getattr(e, "engine_pid", None))), None)

    def ttl_s(self, settings: Settings) -> float:
        if self.model.pinned:
            return math.inf
        if self.keep_alive_s is not None:
            return self.keep_alive_s
        return self.model.spec.ttl_s if self.model.spec.ttl_s is not None else settings.idle_unload_s

    def expires_at(self, settings: Settings) -> float | None:
        """Wall-clock time it unloads if no request comes (None: never)."""
        ttl = self.ttl_s(settings)
        if math.isinf(ttl):
            return None
        return time.time() + max(0.0, ttl - (time.monotonic() - self.last_used_s)) if not self.leases else \
            time.time() + ttl

    def max_model_len(self) -> int | None:
        if self.engine is not None:
            return self.engine.max_model_len
        if self.embedder is not None:
            return self.embedder.max_seq_length
        return None


ChatLoader = Callable[[Settings], Any]
EmbedderLoader = Callable[[Settings, CatalogModel], Any]


class ModelRegistry:
    """The served models by every name that routes to them.

    Args:
        settings: the server's settings.
        catalog: the models (the first is the default chat model).
        one_model: a one-model server (its models pinned; errors as a one-model server always gave them).
        chat_loader: loads a chat engine from settings whose ``model`` is the folder (blocking; run in a thread).
        embedder_loader: loads an embedding engine for a catalog model (blocking; run in a thread).
    """

    def __init__(self, settings: Settings, catalog: list[CatalogModel], *, one_model: bool,
                 chat_loader: ChatLoader | None, embedder_loader: EmbedderLoader | None) -> None:
        self.settings = settings
        self.entries = [ModelEntry(model) for model in catalog]
        self.one_model = one_model
        self.chat_loader, self.embedder_loader = chat_loader, embedder_loader
        # NOTE(hub): without --memory-budget, the device's memory or RAM (default_memory_budget), known from
        # start() on: selecting the device imports onnxruntime and may register an EP library, off the event loop
        self.budget_bytes: int | None = parse_bytes(settings.memory_budget) if settings.memory_budget else None
        self.budget_source = "--memory-budget" if settings.memory_budget else ""
        self._by_name: dict[str, ModelEntry] = {}
        for entry in self.entries:
            for alias in entry.model.names:
                self._by_name.setdefault(alias, entry)
        self._room: asyncio.Lock | None = None
        self._reaper: asyncio.Task | None = None
        self._held: asyncio.Task | None = None
        self.on_unload: list[Callable[[ModelEntry], None]] = []

    # -- names --------------------------------------------------------------------------------------------------

    @property
    def default(self) -> ModelEntry:
        return self.entries[0]

    def served_names(self, kind: str | None = None) -> list[str]:
        return [e.name for e in self.entries if kind is None or e.kind == kind]

    def find(self, name: str | None) -> ModelEntry | None:
        if name is None:
            return self.default
        entry = self._by_name.get(name)
        if entry is None:  # the engine's own name (a folder's) also routes, once loaded
            entry = next((e for e in self.entries if e.engine is not None and e.engine.model_name == name), None)
        if entry is None and name.endswith(OLLAMA_TAG):
            # NOTE(hub): Ollama's names carry a tag, and a name without one means ":latest"; its clients (Open WebUI
            # among them) add it, and /api/tags lists ours with it
            entry = self.find(name.removesuffix(OLLAMA_TAG))
        return entry

    def lookup(self, name: str | None, kind: str) -> ModelEntry:
        """The entry a request's ``model`` routes to for ``kind`` ("chat" or "embedding").

        Raises:
            ModelNotFoundError (404) for an unknown name; ModelCannotError (400) for a model of the other kind.
        """
        if kind == "embedding":
            return self._lookup_embedder(name)
        entry = self.find(name)
        if entry is None:
            raise ModelNotFoundError(name or "", self.default.name, also=self.served_names()[1:])
        if entry.kind is None and entry is not self.default:
            resolve_kind(entry.model)
        if entry.kind == "embedding":
            raise ModelCannotError(f"The model {name!r} is an embedding model: it serves /v1/embeddings, not "
                                   f"chat or completions (this server's chat model is {self.default.name!r}).")
        return entry

    def _lookup_embedder(self, name: str | None) -> ModelEntry:
        if name is None:
            entry = next((e for e in self.entries if e.kind == "embedding"), None)
            entry = entry or next((e for e in self.entries if e.model.chat_embeddings), None)
        else:
            entry = self.find(name)
            if entry is None:
                raise ModelNotFoundError(name, self.default.name, also=self.served_names()[1:])
            if entry.kind is None:
                resolve_kind(entry.model)
        if entry is None or (entry.kind != "embedding" and not entry.model.chat_embeddings):
            chat = self.default.name if entry is None else name
            raise ModelCannotError(
                f"The model {chat!r} does not serve embeddings: it is a chat model and this server was started "
                f"without --embeddings (pooled hidden states of the chat model) or --embedding-model NAME.")
        return entry

    # -- a request's model ----------------------------------------------------------------------------------------

    async def acquire(self, request: Any, name: str | None, kind: str, keep_alive_s: float | None = None
                      ) -> ModelEntry:
        """Route a request to its model, loading it first if needed, and hold a lease on it until the response
        has been sent (``LeaseMiddleware``).

        Args:
            request: the Starlette request (its ``state`` carries the lease).
            keep_alive_s: Ollama's keep_alive / LM Studio's ttl: how long the model stays loaded once idle.

        Raises:
            the lookup's 404/400; EngineNotReadyError (503) while it loads past --load-timeout-s, when its load
            failed, or when the memory budget has no room (MemoryBudgetError).
        """
        entry = self.lookup(name, kind)
        if entry.status == READY and not entry.alive and not self.fixed(entry):
            # its engine process died: a reload serves this request
            logger.warning("model %s: its engine has stopped; reloading it", entry.name)
            await self.unload(entry)
        if entry.status != READY:
            await self._wait_loaded(entry)
        entry.leases += 1
        entry.last_used_s = time.monotonic()
        if keep_alive_s is not None:
            entry.keep_alive_s = math.inf if keep_alive_s < 0 else keep_alive_s
        leases = getattr(request.state, "ortserve_leases", None)
        if leases is None:  # an app without LeaseMiddleware (never in create_app's): nothing would release it
            entry.leases -= 1
        else:
            leases.append(entry)
        return entry

    def release(self, entry: ModelEntry) -> None:
        entry.leases -= 1
        entry.last_used_s = time.monotonic()

    def fixed(self, entry: ModelEntry) -> bool:
        """A one-model server's model: loaded before the server is ready, never unloaded nor reloaded (a dead
        engine answers 503, as a one-model server always did)."""
        return self.one_model and entry.model.pinned

    async def _wait_loaded(self, entry: ModelEntry) -> None:
        if self.fixed(entry):
            return  # the server's own status answers (ServerState.require_engine)
        if entry.task is None or entry.task.done():
            entry.task = asyncio.create_task(self._load(entry), name=f"load {entry.name}")
        try:
            # NOTE(hub): shielded, so a request that gives up (timeout, client gone) never cancels the load
            await asyncio.wait_for(asyncio.shield(entry.task), timeout=self.settings.load_timeout_s)
        except TimeoutError:
            raise EngineNotReadyError(f"The model {entry.name!r} is still loading; retry shortly.",
                                      code="model_loading",
                                      headers={"Retry-After": str(LOADING_RETRY_AFTER_S)}) from None
        if entry.status != READY:
            raise EngineNotReadyError(f"The model {entry.name!r} failed to load: {entry.load_error}",
                                      code="model_load_failed")

    # -- loading and unloading ------------------------------------------------------------------------------------

    async def load(self, entry: ModelEntry) -> None:
        """Load ``entry`` now (admin endpoints, pinned models at start-up); returns when ready or failed."""
        if entry.status == READY and entry.alive:
            return
        if entry.status == READY:
            await self.unload(entry)
        if entry.task is None or entry.task.done():
            entry.task = asyncio.create_task(self._load(entry), name=f"load {entry.name}")
        await asyncio.shield(entry.task)

    def _model_settings(self, entry: ModelEntry) -> Settings:
        """Resolve the model's folder (pulling a known name on first use) and its settings (blocking)."""
        model = entry.model
        if self.fixed(entry) and entry is self.default:
            return self.settings  # a one-model server's own settings, resolved by its loader as they always were
        if model.folder is None:
            from engine.builder import resolve_model
            from ep.model_dtype import choose_model_dtype

            dtype = choose_model_dtype(model.spec.provider or self.settings.provider, self.settings.device,
                                       self.settings.ep_library, self.settings.dtype)
            model.folder = Path(resolve_model(model.spec.model, dtype=dtype.dtype))
            model.kind = model.kind or kind_of_folder(model.folder)
        settings = model.settings_for(self.settings)
        if not self.one_model:
            # NOTE(hub): each model's session in a process of its own (an embedding model's too: the embedder
            # loader reads the flag from the catalog model): a crash or a kill of one leaves the others serving,
            # and unloading gives back all of its memory. A one-model server keeps its engines where they were.
            settings = settings.model_copy(update={"engine_process": True})
            model.extra["engine_process"] = True
        return settings

    async def _load(self, entry: ModelEntry) -> None:
        started = time.monotonic()
        entry.status, entry.load_error = LOADING, None
        try:
            settings = await anyio.to_thread.run_sync(self._model_settings, entry)
            if not self.fixed(entry):  # a one-model server's models are not budgeted: they are the server
                entry.estimate_bytes = await anyio.to_thread.run_sync(estimate_bytes, entry.model.folder, settings)
                await self._make_room(entry)
            if entry.kind == "chat":
                assert self.chat_loader is not None, "no chat loader"
                entry.engine = await anyio.to_thread.run_sync(self.chat_loader, settings)
                if entry.model.chat_embeddings and self.embedder_loader is not None:
                    entry.embedder = await anyio.to_thread.run_sync(self.embedder_loader, settings, entry.model)
            else:
                assert self.embedder_loader is not None, "no embedding loader"
                entry.embedder = await anyio.to_thread.run_sync(self.embedder_loader, settings, entry.model)
        except MemoryBudgetError as exc:
            entry.status, entry.load_error = UNLOADED, str(exc)
            raise
        except Exception as exc:
            from engine.types import EngineError

            entry.status, entry.load_error = FAILED, f"{type(exc).__name__}: {exc}"
            logger.error("loading the model failed (%s): %s", entry.name, entry.load_error,
                         exc_info=None if isinstance(exc, EngineError) else exc)
            return
        if not self.one_model:
            hold_loaded(entry.model, entry.engine if entry.engine is not None else entry.embedder)
        entry.status, entry.num_loads = READY, entry.num_loads + 1
        entry.load_time_s, entry.loaded_at = time.monotonic() - started, time.time()
        entry.last_used_s = time.monotonic()
        kv = getattr(entry.engine, "kv_cache_bytes", None)
        logger.info("model %s loaded in %.1f s (estimated %s%s)", entry.name, entry.load_time_s,
                    format_bytes(entry.estimate_bytes), f"; KV {format_bytes(kv)}" if kv else "")

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload least recently used idle models until ``entry`` fits the budget (its status is LOADING, so a
        concurrent load counts it as used)."""
        if self._room is None:
            self._room = asyncio.Lock()
        async with self._room:
            await self._find_budget()
            assert self.budget_bytes is not None
            while True:
                others = [e for e in self.entries if e is not entry and e.status in (LOADING, READY)]
                used = sum(e.estimate_bytes for e in others)
                if used + entry.estimate_bytes <= self.budget_bytes:
                    return
                idle = [e for e in others if e.status == READY and e.leases == 0 and not e.model.pinned]
                held = used - sum(e.estimate_bytes for e in idle)
                if held + entry.estimate_bytes > self.budget_bytes:
                    # NOTE(hub): even with every idle model gone it would not fit: unload none of them for nothing
                    busy = [f"{e.name!r} ({format_bytes(e.estimate_bytes)})" for e in others if e not in idle]
                    raise MemoryBudgetError(entry.name, entry.estimate_bytes, held, self.budget_bytes, busy)
                victim = min(idle, key=lambda e: e.last_used_s)
                logger.info("evicting the idle model %s (%s) to make room for %s (%s)", victim.name,
                            format_bytes(victim.estimate_bytes), entry.name, format_bytes(entry.estimate_bytes))
                await self.unload(victim)

    async def unload(self, entry: ModelEntry) -> None:
        """Shut the model's engine down (its engine process ends) and forget it; the next request loads it again."""
        engine, embedder = entry.engine, entry.embedder
        entry.engine = entry.embedder = None
        entry.status, entry.keep_alive_s = UNLOADED, None
        for callback in self.on_unload:
            callback(entry)
        if entry.owned:
            await _shutdown(engine, embedder)
        logger.info("model %s unloaded", entry.name)

    async def _find_budget(self) -> None:
        if self.budget_bytes is None:
            self.budget_bytes, self.budget_source = await anyio.to_thread.run_sync(
                lambda: default_memory_budget(selected_device(self.settings)))

    async def start(self) -> None:
        """Find the memory budget and start the idle reaper (pinned models are loaded by the app's lifespan)."""
        if not self.one_model:  # NOTE(hub): a one-model server's models are the server: never budgeted
            await self._find_budget()
        if self._reaper is None and any(not e.model.pinned for e in self.entries):
            self._reaper = asyncio.create_task(self._reap(), name="hub reaper")
        if not self.one_model and self._held is None:
            self._held = asyncio.create_task(anyio.to_thread.run_sync(hold_listed, [e.model for e in self.entries]),
                                             name="hub tokenizers")

    async def stop(self) -> None:
        """Stop the reaper, wait for loads, and shut every owned model down."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        if self._held is not None:
            await asyncio.gather(self._held, return_exceptions=True)  # a parse in its thread cannot be cancelled
        loads = [e.task for e in self.entries if e.task is not None and not e.task.done()]
        if loads:
            await asyncio.wait(loads)  # a half-loaded session cannot be cancelled
        for entry in self.entries:
            if entry.status == READY or entry.engine is not None or entry.embedder is not None:
                await self.unload(entry)

    def _period_s(self) -> float:
        ttls = [e.ttl_s(self.settings) for e in self.entries if not e.model.pinned]
        return min(1.0, max(0.05, min(ttls, default=1.0) / 4))

    def to_reap(self, now_s: float) -> list[ModelEntry]:
        """The loaded models to unload at monotonic time ``now_s``: idle (no request holds them) past their
        keep-alive (ttl_s), or whose engine process died; never a pinned one."""
        return [e for e in self.entries if e.status == READY and not e.leases and not e.model.pinned
                and (not e.alive or now_s - e.last_used_s >= e.ttl_s(self.settings))]

    async def _reap(self) -> None:
        """Unload models idle past their keep-alive; forget engines whose process died (reloaded on demand)."""
        while True:
            await asyncio.sleep(self._period_s())
            now = time.monotonic()
            for entry in self.to_reap(now):
                if entry.leases or entry.status != READY:  # taken while an earlier one was unloading
                    continue
                if not entry.alive:
                    logger.warning("model %s: its engine has stopped; unloading it", entry.name)
                else:
                    logger.info("model %s idle for %.1f s: unloading it", entry.name, now - entry.last_used_s)
                await self.unload(entry)


def selected_device(settings: Settings) -> Any | None:
    """The device the server's --provider and --device select, as ep.device reports it (a DeviceRecord); None for
    the CPU or where selection fails (the budget is then RAM's). Blocking; imports onnxruntime."""
    from ep.names import normalize_provider

    try:
        if normalize_provider(settings.provider, allow_auto=True) == "cpu":
            return None
        from ep.device import select_device

        return select_device(settings.provider, settings.device, settings.ep_library).record
    except Exception as exc:  # the engines report a bad --provider/--device themselves, with their own errors
        logger.warning("memory budget: no device selected (%s: %s); using RAM", type(exc).__name__, exc)
        return None


async def _shutdown(*engines: Any) -> None:
    for engine in engines:
        if engine is None:
            continue
        # NOTE(hub): shutdown joins the engine thread or reaps its process (blocking), so it runs off the loop
        if inspect.iscoroutinefunction(engine.shutdown):
            await engine.shutdown()
        else:
            await anyio.to_thread.run_sync(engine.shutdown)
    from server.http.memory import give_back_memory

    await anyio.to_thread.run_sync(give_back_memory)


class LeaseMiddleware:
    """Releases the model leases a request took (ModelRegistry.acquire) once its whole response has been sent,
    streams included (pure ASGI: the app call returns after the last body message)."""

    def __init__(self, app: Any, registry: Callable[[], ModelRegistry]) -> None:
        self.app = app
        self.registry = registry

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[ModelEntry] = []
        scope.setdefault("state", {})["ortserve_leases"] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            registry = self.registry()
            for entry in leases:
                registry.release(entry)
