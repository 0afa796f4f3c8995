"""GET /v1/models and GET /v1/models/{model}: every model of the server (the hub's catalog), loaded or not."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.errors import ModelNotFoundError
from server.hub.catalog import resolve_kind
from server.hub.registry import READY, ModelEntry
from server.openai import protocol
from server.state import ServerState, get_state

router = APIRouter(tags=["models"])


def model_card(state: ServerState, entry: ModelEntry) -> dict:
    """OpenAI's model object, with the hub's fields beside it: ``loaded`` (and llama-server's ``status``) and the
    ``max_model_len`` of a loaded model (``dimensions`` for an embedding model's vectors)."""
    embedder = entry.embedder if entry.engine is None else None
    card = protocol.model_card(entry.name, state.started_at, max_model_len=entry.max_model_len(),
                               dimensions=embedder.dimension if embedder is not None else None)
    card["loaded"] = entry.status == READY
    card["status"] = {"value": "loaded" if entry.status == READY else entry.status}
    # NOTE(hub): a known name not pulled yet has its kind from the known names' table (no folder to read yet)
    card["kind"] = entry.kind or resolve_kind(entry.model)
    return card


@router.get("/v1/models", summary="List models")
@router.head("/v1/models", include_in_schema=False)
async def list_models(request: Request) -> dict:
    state = get_state(request)
    return {"object": "list", "data": [model_card(state, entry) for entry in state.registry.entries]}


@router.get("/v1/models/{model:path}", summary="Retrieve a model")
@router.head("/v1/models/{model:path}", include_in_schema=False)
async def retrieve_model(model: str, request: Request) -> dict:
    state = get_state(request)
    entry = state.registry.find(model)
    if entry is None:
        raise ModelNotFoundError(model, state.served_model_name, also=state.registry.served_names()[1:])
    return model_card(state, entry)
