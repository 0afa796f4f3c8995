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

from server.engine_client import EngineClient
from server.errors import EngineNotReadyError
from server.metrics import ServerMetrics
from server.response_store import ResponseStore
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
    started_at: int = field(default_factory=lambda: int(time.time()))
    # Called (from the event loop) when loading fails, e.g. by the CLI to stop the server with exit 1.
    on_load_failed: Callable[[str], None] | None = None
    # Stored Responses (POST /v1/responses with store=true); bounded by the settings, not persistent.
    responses: ResponseStore = field(init=False)

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
