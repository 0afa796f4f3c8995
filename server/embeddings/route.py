"""POST /v1/embeddings (OpenAI's) and llama.cpp's POST /embedding and /embeddings: tokenize in a thread, embed on
the model's embedding engine (its own thread and queue), answer in input order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.types import InvalidRequestError
from server.embeddings import protocol as wire
from server.engine_client import EmbedderClient
from server.state import ServerState, get_state

router = APIRouter(tags=["embeddings"])


def _token_ids(embedder: EmbedderClient, inputs: Sequence[wire.EmbeddingInput],
               truncate_to: int | None) -> list[list[int]]:
    """Every input as checked token ids (texts tokenized in one batch); runs in a worker thread."""
    texts = [(i, item.text) for i, item in enumerate(inputs) if item.text is not None]
    for i, text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            param = inputs[i].param
            raise InvalidRequestError(f"{param} must be valid Unicode text (it holds a lone surrogate escape)",
                                      param=param, code="invalid_value") from None
    tokenized = dict(zip((i for i, _ in texts), embedder.tokenize([t for _, t in texts], truncate_to)))
    ids = [tokenized[i] if item.text is not None else list(item.token_ids or ()) for i, item in enumerate(inputs)]
    return embedder.check(ids, truncate_to=truncate_to, params=[item.param for item in inputs])


def _dimensions(embedder: EmbedderClient, requested: int | None) -> int | None:
    """The dimensions to truncate to (None: the model's own); a 400 naming the field when the model can't."""
    if requested is None or requested == embedder.dimension:
        return None
    trained = getattr(getattr(embedder, "folder", None), "matryoshka_dimensions", ())
    if requested in trained:
        return requested
    also = f"; it was trained to be truncated to {sorted(trained)}" if trained else \
        " (it was not trained to be truncated: no Matryoshka dimensions)"
    raise InvalidRequestError(f"dimensions {requested} is not supported by {embedder.model_name!r}: its embeddings "
                              f"have {embedder.dimension} dimensions{also}", param="dimensions",
                              code="invalid_value")


async def _embed(state: ServerState, name: str, embedder: EmbedderClient, inputs: Sequence[wire.EmbeddingInput],
                 truncate_to: int | None) -> tuple[list[np.ndarray], int]:
    """(vectors, prompt tokens), recording the embedding metrics of a success under the model's ``name``."""
    start = time.perf_counter()
    token_ids = await anyio.to_thread.run_sync(_token_ids, embedder, inputs, truncate_to)
    vectors = await embedder.embed(token_ids)
    num_tokens = sum(len(ids) for ids in token_ids)
    m = state.metrics
    m.embedding_requests.labels(name, "ok").inc()
    m.embedding_inputs.labels(name).inc(len(token_ids))
    m.embedding_tokens.labels(name).inc(num_tokens)
    m.embedding_latency.labels(name).observe(time.perf_counter() - start)
    return vectors, num_tokens


@router.post("/v1/embeddings", summary="Create embeddings")
async def create_embeddings(body: wire.EmbeddingRequest, request: Request) -> JSONResponse:
    state = get_state(request)
    entry = await state.acquire(request, body.model, "embedding", body.ttl)
    request.state.ortserve_model = entry.name
    name, embedder = entry.name, entry.embedder
    if embedder.pooling == "none":
        raise InvalidRequestError(f"the model {name!r} is served with pooling 'none' (one vector per token), which "
                                  f"/v1/embeddings cannot answer; use /embeddings, or serve it with another "
                                  f"--pooling", param="model", code="model_not_supported")
    inputs = body.inputs()
    dims = _dimensions(embedder, body.dimensions)
    vectors, num_tokens = await _embed(state, name, embedder, inputs, body.truncate_to(embedder.max_seq_length))
    if dims is not None:  # Matryoshka: the leading dimensions, re-normalized
        vectors = [v[:dims] / max(float(np.linalg.norm(v[:dims])), 1e-12) for v in vectors]
    return JSONResponse(wire.embedding_response(vectors, name, num_tokens, body.encoding_format))


@router.post("/embedding", summary="Embeddings, llama.cpp's form")
@router.post("/embeddings", include_in_schema=False)
async def create_embeddings_llamacpp(body: wire.LlamaCppEmbeddingRequest, request: Request) -> JSONResponse:
    """llama.cpp's non-OpenAI endpoint: [{"index", "embedding": [[...]]}] (per token with pooling 'none')."""
    state = get_state(request)
    entry = await state.acquire(request, body.model, "embedding")
    request.state.ortserve_model, embedder = entry.name, entry.embedder
    vectors, _ = await _embed(state, entry.name, embedder, body.inputs(), None)
    return JSONResponse(wire.llamacpp_embedding_response(vectors))
