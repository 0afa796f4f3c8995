"""GET /v1/models and GET /v1/models/{model}: the chat model and the embedding models."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.openai import protocol
from server.errors import ModelNotFoundError
from server.state import get_state

router = APIRouter(tags=["models"])


def _card(request: Request) -> dict:
    state = get_state(request)
    max_len = state.engine.max_model_len if state.engine is not None else None
    return protocol.model_card(state.served_model_name, state.started_at, max_model_len=max_len)


def _embedding_card(request: Request, name: str) -> dict:
    state = get_state(request)
    embedder = state.embedders[name]
    return protocol.model_card(name, state.started_at, max_model_len=embedder.max_seq_length,
                               dimensions=embedder.dimension)


@router.get("/v1/models", summary="List models")
@router.head("/v1/models", include_in_schema=False)
async def list_models(request: Request) -> dict:
    state = get_state(request)
    chat = _card(request)
    embedders = [_embedding_card(request, name) for name in state.embedding_names() if name != chat["id"]]
    return {"object": "list", "data": [chat, *embedders]}


@router.get("/v1/models/{model:path}", summary="Retrieve a model")
@router.head("/v1/models/{model:path}", include_in_schema=False)
async def retrieve_model(model: str, request: Request) -> dict:
    state = get_state(request)
    if not state.accepts_model(model):
        if model in state.embedders:
            return _embedding_card(request, state.require_embedder(model)[0])
        raise ModelNotFoundError(model, state.served_model_name, also=state.embedding_names())
    return _card(request)
