"""The hub's admin endpoints (behind the API key like every other): list, load and unload models, under
llama-server's router-mode names (GET /models, POST /models/load, POST /models/unload)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.types import InvalidRequestError
from server.errors import ModelNotFoundError
from server.hub.registry import READY, ModelEntry
from server.state import ServerState, get_state

router = APIRouter(tags=["models"])


class ModelAction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="A served model name or alias.")


def _entry(state: ServerState, name: str) -> ModelEntry:
    entry = state.registry.find(name)
    if entry is None:
        raise ModelNotFoundError(name, state.served_model_name, also=state.registry.served_names()[1:])
    return entry


def describe(state: ServerState, entry: ModelEntry) -> dict:
    """One model as the admin endpoints, /api/ps and the chat page see it."""
    ttl = entry.ttl_s(state.settings)
    return {
        "id": entry.name, "aliases": [n for n in dict.fromkeys(entry.model.names) if n != entry.name],
        "kind": entry.kind, "status": {"value": "loaded" if entry.status == READY else entry.status},
        "loaded": entry.status == READY, "pinned": entry.model.pinned,
        "pid": entry.pid, "requests": entry.leases, "load_time_s": entry.load_time_s,
        "estimated_bytes": entry.estimate_bytes or None, "max_model_len": entry.max_model_len(),
        "ttl_s": None if ttl == float("inf") else ttl, "expires_at": entry.expires_at(state.settings),
        "error": entry.load_error,
    }


@router.get("/models", summary="List the models and which are loaded (llama-server's router mode)")
async def list_models(request: Request) -> dict:
    state = get_state(request)
    return {"object": "list", "data": [describe(state, e) for e in state.registry.entries],
            "memory_budget_bytes": state.registry.budget_bytes, "memory_budget_source": state.registry.budget_source}


@router.post("/models/load", summary="Load a model now")
async def load_model(body: ModelAction, request: Request) -> dict:
    state = get_state(request)
    state.require_ready()
    entry = _entry(state, body.model)
    await state.registry.acquire(request, entry.name, entry.kind or "chat")  # the budget's 503 and load errors
    return {"success": True, "model": describe(state, entry)}


@router.post("/models/unload", summary="Unload a model (after its running requests)")
async def unload_model(body: ModelAction, request: Request) -> dict:
    """A model with requests running unloads when they end (its keep-alive becomes 0); a pinned one unloads now
    too, and loads again on its next request."""
    state = get_state(request)
    entry = _entry(state, body.model)
    if state.registry.fixed(entry):
        raise InvalidRequestError(f"The model {entry.name!r} is this one-model server's own: it is never unloaded "
                                  f"(serve several with --model repeated, --models-dir or --config).",
                                  param="model", code="model_pinned")
    if entry.status == READY and not entry.leases:
        await state.registry.unload(entry)
    elif entry.status == READY:
        entry.keep_alive_s = 0.0
    return {"success": True, "model": describe(state, entry)}
