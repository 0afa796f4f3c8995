"""ServerState, what one app instance owns (settings, the model registry, load status, metrics, the state store and
this process's jobs), and get_state(request).

Routes reach the state through get_state, so they never import server.app (which imports them). No
onnxruntime import.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from server.engine_client import EmbedderClient, EngineClient
from server.errors import EngineNotReadyError
from server.hub.catalog import CatalogModel, build_catalog
from server.hub.registry import READY, ModelEntry, ModelRegistry
from server.metrics import ServerMetrics
from server.jobs import Jobs
from server.settings import ModelSpec, Settings
from server.store import Store, open_store


def serves_one_model(settings: Settings) -> bool:
    """A server of --model alone (and its --embedding-model): the registry's degenerate case."""
    return not settings.models and not settings.models_dir


@dataclass
class ServerState:
    """Everything one app instance owns; stored on `app.state.ortserve`.

    ``status`` is the server's: loading (its pinned models: a one-model server's model) -> ready | failed ->
    stopping. Each model's own status is its registry entry's.
    """

    settings: Settings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    status: str = "loading"
    load_error: str | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))
    # Called (from the event loop) when loading fails, e.g. by the CLI to stop the server with exit 1.
    on_load_failed: Callable[[str], None] | None = None
    # Called (in a thread) once the pinned models loaded, just before the server says it is ready: an API process
    # of several (server.api_servers) waits there for the others.
    before_ready: Callable[[], None] | None = None
    # What outlives a request (stored responses, conversations, files, batches): started by the app's lifespan.
    store: Store = field(init=False)
    jobs: Jobs = field(init=False)  # this process's background responses and batches
    # The app itself (ASGI): a batch line is a request to it, through the same routes (server.batches.runner).
    app: Any = None
    registry: ModelRegistry = field(init=False)

    def __post_init__(self) -> None:
        self.store = open_store(self.settings.state_url)
        self.jobs = Jobs(self.store, self.settings)
        one = serves_one_model(self.settings)
        self.registry = ModelRegistry(self.settings, build_catalog(self.settings, one), one_model=one,
                                      chat_loader=None, embedder_loader=None)
        # every series carries model_name; a request refused before it was routed counts under the default model
        self.metrics.default_model = self.registry.default.name
        self.metrics.export_zeros(self.metrics.default_model)
        for entry in self.registry.entries:
            if entry.kind == "embedding" or entry.model.chat_embeddings:
                self.metrics.export_zeros(entry.name, "embedding")

    # -- the default model (a one-model server's only one) ------------------------------------------------------

    @property
    def engine(self) -> EngineClient | None:
        return self.registry.default.engine

    @engine.setter
    def engine(self, engine: EngineClient | None) -> None:
        """An engine given to the app (tests): the default model, loaded, never shut down by the app."""
        entry = self.registry.default
        entry.engine, entry.owned = engine, engine is None
        entry.status = READY if engine is not None else entry.status

    @property
    def served_model_name(self) -> str:
        return self.registry.default.name

    @property
    def embedders(self) -> dict[str, EmbedderClient]:
        """Loaded embedding engines by every name a request may give."""
        return {name: entry.embedder for entry in self.registry.entries if entry.embedder is not None
                for name in dict.fromkeys([entry.name, *entry.model.names])}

    def add_embedders(self, embedders: dict[str, Any]) -> None:
        """Embedding engines given to the app (tests), by name: a catalog model's, or a model of their own."""
        registry = self.registry
        for name, embedder in embedders.items():
            entry = registry.find(name)
            if entry is None or (entry.kind == "chat" and not entry.model.chat_embeddings and name != entry.name):
                model = CatalogModel(ModelSpec(model=name, name=name, kind="embedding"), name, [name], "embedding",
                                     pinned=True)
                entry = ModelEntry(model)
                registry.entries.append(entry)
                registry._by_name.setdefault(name, entry)
            elif entry.kind == "chat":
                entry.model.chat_embeddings = True
            entry.embedder, entry.owned, entry.status = embedder, False, READY

    def metric_model(self, request: Request, kind: str = "chat") -> str:
        """The model_name a request's metrics carry: the model it was routed to, else the default of its kind."""
        routed = getattr(request.state, "ortserve_model", None)
        if routed:
            return routed
        if kind == "embedding":
            entry = next((e for e in self.registry.entries if e.kind == "embedding" or e.model.chat_embeddings),
                         None)
            if entry is not None:
                return entry.name
        return self.served_model_name

    def embedding_names(self) -> list[str]:
        """The served name of each loaded embedding engine."""
        return [entry.name for entry in self.registry.entries if entry.embedder is not None]

    def require_engine(self) -> EngineClient:
        """The default model's engine; 503 while the server loads, after a failed load or while stopping."""
        self.require_ready()
        engine = self.engine
        if engine is None:
            raise EngineNotReadyError("The model is still loading; retry shortly.", code="model_loading",
                                      headers={"Retry-After": "1"})
        return engine

    def require_ready(self) -> None:
        if self.status == "ready":
            return
        if self.status == "failed":
            raise EngineNotReadyError(f"The model failed to load: {self.load_error}", code="model_load_failed")
        if self.status == "stopping":
            raise EngineNotReadyError("The server is shutting down.", code="shutting_down")
        raise EngineNotReadyError("The model is still loading; retry shortly.", code="model_loading",
                                  headers={"Retry-After": "1"})

    async def acquire(self, request: Request, name: str | None, kind: str = "chat",
                      keep_alive_s: float | None = None) -> ModelEntry:
        """The model a request's ``model`` routes to, loaded (ModelRegistry.acquire), once the server is ready."""
        self.require_ready()
        return await self.registry.acquire(request, name, kind, keep_alive_s)


def get_state(request: Request) -> ServerState:
    return request.app.state.ortserve
