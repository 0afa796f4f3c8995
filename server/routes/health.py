"""GET /health (503 until the model is loaded) and GET /version."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server import __version__
from server.hub.registry import ModelEntry
from server.state import get_state

router = APIRouter(tags=["service"])


# NOTE(server): HEAD too (load balancers check health with it), and "/health/" answered, not redirected; both
# kept out of the OpenAPI schema, which describes GET /health once.
@router.get("/health", summary="Liveness and readiness")
@router.head("/health", include_in_schema=False)
@router.api_route("/health/", methods=["GET", "HEAD"], include_in_schema=False)
async def health(request: Request) -> JSONResponse:
    """200 {"status": "ok", "models": [...]} once the server is ready, with each loaded model (its name, status,
    engine process, load time); 503 with "loading", "failed" or "stopping" before/after.

    A one-model server is not ready while its model is not; a hub is ready while any of its models loads or
    fails (each model's own status is in ``models``)."""
    state = get_state(request)
    registry = state.registry
    # NOTE(server): an engine whose core thread died is not ready, whatever the load status says.
    engine_alive = state.engine is not None and getattr(state.engine, "is_running", True)
    loaded = [_loaded(entry) for entry in registry.entries if entry.status in ("loading", "ready")]
    if state.status == "ready" and (engine_alive or not registry.one_model):
        return JSONResponse({"status": "ok", "model": state.served_model_name, "models": loaded})
    if state.status == "ready":
        return JSONResponse({"status": "failed", "error": "the engine has stopped"}, status_code=503)
    body = {"status": state.status}
    if state.load_error:
        body["error"] = state.load_error
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"} if state.status == "loading" else None)


def _loaded(entry: ModelEntry) -> dict:
    item = {"name": entry.name, "status": entry.status if entry.alive or entry.status != "ready" else "failed",
            "kind": entry.kind, "pid": entry.pid, "load_time_s": entry.load_time_s, "requests": entry.leases}
    return {key: value for key, value in item.items() if value is not None}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@router.get("/version", summary="Server and runtime versions")
@router.head("/version", include_in_schema=False)
async def version(request: Request) -> dict:
    state = get_state(request)
    return {
        "version": __version__,
        "onnxruntime": _dist_version("onnxruntime"),
        "model": state.served_model_name,
    }
