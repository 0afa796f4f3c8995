"""ServerState, what one app instance owns (settings, engine, load status, metrics, stored responses), and
get_state(request).

Routes reach the state through get_state, so they never import server.app (which imports them). No
onnxruntime import.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request

from server.engine_client import EmbedderClient, EngineClient
from server.errors import EngineNotReadyError, ModelCannotError, ModelNotFoundError
from server.metrics import ServerMetrics
from server.responses.store import ResponseStore
from server.settings import Settings


@dataclass
class ServerState:
    """Everything one app instance owns; stored on `app.state.ortserve`."""

    settings: Settings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    engine: EngineClient | None = None
    status: str = "loading"  # loading -> ready | failed -> stopping
    load_error: str | None = None
    owns_engine: bool = False
    owns_embedders: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))
    # Called (from the event loop) when loading fails, e.g. by the CLI to stop the server with exit 1.
    on_load_failed: Callable[[str], None] | None = None
    # Stored Responses (POST /v1/responses with store=true); bounded by the settings, not persistent.
    responses: ResponseStore = field(init=False)
    # Embedding engines by every name a request may give (--embedding-model, and the chat model's own names
    # with --embeddings); loaded with the chat engine, before the server reports ready.
    embedders: dict[str, EmbedderClient] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.settings.response_store_size, self.settings.response_store_bytes)

    @property
    def served_model_name(self) -> str:
        if self.settings.served_model_name:
            return self.settings.served_model_name
        if self.engine is not None:
            return self.engine.model_name
        return Path(self.settings.model).name or self.settings.model

    def accepts_model(self, name: str | None) -> bool:
        """None, the served name, the engine's own name or the --model value all mean this model."""
        if name is None:
            return True
        names = {self.served_model_name, self.settings.model}
        if self.engine is not None:
            names.add(self.engine.model_name)
        return name in names

    def embedding_names(self) -> list[str]:
        """The served name of each embedding engine (the first name it was registered under)."""
        seen: dict[int, str] = {}
        for name, embedder in self.embedders.items():
            seen.setdefault(id(embedder), name)
        return list(seen.values())

    def require_chat_model(self, name: str | None) -> None:
        """A 400 naming the model when ``name`` is an embedding-only model (it cannot chat or complete)."""
        if name is not None and name in self.embedders and not self.accepts_model(name):
            raise ModelCannotError(f"The model {name!r} is an embedding model: it serves /v1/embeddings, not "
                                   f"chat or completions (this server's chat model is {self.served_model_name!r}).")

    def require_embedder(self, name: str | None) -> tuple[str, EmbedderClient]:
        """(served name, engine) for an embeddings request's ``model`` (None: the embedding model, else the chat
        model's own embeddings).

        Raises:
            EngineNotReadyError (503) while loading; ModelCannotError (400) for a chat model served without
            --embeddings, or a server without any embedding model; ModelNotFoundError (404) for another name.
        """
        if self.status != "ready":
            self.require_engine()
        if name is not None and name in self.embedders:
            embedder = self.embedders[name]
            return next(n for n in self.embedding_names() if self.embedders[n] is embedder), embedder
        names = self.embedding_names()
        if name is None and names:
            return names[0], self.embedders[names[0]]
        if name is None or self.accepts_model(name):
            chat = self.served_model_name if name is None else name
            raise ModelCannotError(
                f"The model {chat!r} does not serve embeddings: it is a chat model and this server was started "
                f"without --embeddings (pooled hidden states of the chat model) or --embedding-model NAME.")
        raise ModelNotFoundError(name, self.served_model_name, also=names)

    def require_engine(self) -> EngineClient:
        if self.engine is None or self.status != "ready":
            if self.status == "failed":
                raise EngineNotReadyError(f"The model failed to load: {self.load_error}", code="model_load_failed")
            if self.status == "stopping":
                raise EngineNotReadyError("The server is shutting down.", code="shutting_down")
            raise EngineNotReadyError("The model is still loading; retry shortly.", code="model_loading",
                                      headers={"Retry-After": "1"})
        return self.engine


def get_state(request: Request) -> ServerState:
    return request.app.state.ortserve
