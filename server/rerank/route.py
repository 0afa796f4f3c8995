"""POST /v1/rerank (with /rerank and /v2/rerank) and POST /v1/score on the models the server already has.

An embedding model scores a pair by the cosine of the two embeddings; the chat model by the probability of "yes" to
"Does the document answer the query?", read from its next-token log-probabilities (server.decisions.reading, the
Qwen3-Reranker recipe). ``model`` picks one; none: ``--rerank-model``, else the embedding model, else the chat model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.types import InvalidRequestError
from server.decisions.questions import Question
from server.decisions.reading import ask_pairs
from server.engine_client import EmbedderClient, EngineClient
from server.errors import ModelCannotError
from server.http.prepare import engine_for
from server.http.run import race_disconnect
from server.openai.protocol import new_id
from server.rerank import protocol as wire
from server.state import ServerState, get_state

router = APIRouter(tags=["rerank"])

# The chat model's relevance question (Qwen3-Reranker asks its yes/no the same way).
RELEVANCE = Question("predicate", "The document answers the query.", asked_as="Does the document answer the query?")


async def _scorer(request: Request, state: ServerState, name: str | None) -> tuple[str, EmbedderClient | None,
                                                                           EngineClient | None]:
    """(served name, embedding engine, chat engine: one of the two) for a request's ``model``, loaded (the hub).

    NOTE(server): an embedding model ranks by cosine, a chat model by P(yes) (even one served with --embeddings).
    None: --rerank-model, else the first embedding model, else the default chat model.

    Raises:
        EngineNotReadyError (503) while loading; ModelNotFoundError (404) for an unknown name; ModelCannotError (400)
        for a model that cannot rerank (an embedding model served with pooling 'none').
    """
    state.require_ready()
    registry = state.registry
    if name is None:
        name = state.settings.rerank_model or next((e.name for e in registry.entries if e.kind == "embedding"), None)
    entry = registry.find(name) if name is not None else None
    if entry is not None and entry.kind is None and entry is not registry.default:
        registry.lookup(name, "chat")  # resolves its kind (an embedding model answers ModelCannotError there)
    if entry is not None and entry.kind == "embedding":
        held = await state.acquire(request, name, "embedding")
        embedder = held.embedder
        if embedder is None or embedder.pooling == "none":
            raise ModelCannotError(f"The model {held.name!r} is served with pooling 'none' (a vector per token); it "
                                   f"cannot score a document by one embedding")
        return held.name, embedder, None
    _, engine = await engine_for(request, name)
    return request.state.ortserve_model, None, engine


def _cosines(embedder: EmbedderClient, pairs: Sequence[tuple[str, str]]) -> tuple[list[str], list[list[int]]]:
    """Distinct texts of ``pairs`` and their checked token ids (worker thread)."""
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("the texts must be valid Unicode (one holds a lone surrogate escape)",
                                      param="documents", code="invalid_value") from None
    ids = embedder.check(embedder.tokenize(texts), params=["documents"] * len(texts))
    return texts, ids


async def _scores(served: str, scorer: EmbedderClient | None, engine: EngineClient | None,
                  pairs: Sequence[tuple[str, str]]) -> tuple[list[float], int]:
    """One score per (query, document) pair and the tokens read (by ``scorer``, else the chat ``engine``)."""
    if scorer is not None:
        texts, ids = await anyio.to_thread.run_sync(_cosines, scorer, pairs)
        vectors = await scorer.embed(ids)
        unit = {}
        for text, v in zip(texts, vectors):
            v = np.asarray(v, dtype=np.float64)
            unit[text] = v / max(float(np.linalg.norm(v)), 1e-12)
        # NOTE(server): each text once in the count, as the embeddings it took (a query shared by all pairs once)
        return [float(np.dot(unit[a], unit[b])) for a, b in pairs], sum(len(x) for x in ids)
    inputs = [[{"role": "user", "content": f"Query: {query}\n\nDocument: {doc}"}] for query, doc in pairs]
    assert engine is not None
    outcome = await ask_pairs(engine, [(m, RELEVANCE) for m in inputs], new_id("rerank"), input_param="documents")
    if any(a is None for a in outcome.answers):
        raise ModelCannotError(f"The model {served!r} cannot rerank: 'yes' and 'no' are not single "
                               f"tokens where its answer starts")
    return [a[0].probabilities[0] for a in outcome.answers if a is not None], outcome.num_input_tokens


@router.post("/v1/rerank", summary="Rerank documents for a query (Jina's and Cohere's shape; TEI's with 'texts')")
@router.post("/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
async def rerank(body: wire.RerankRequest, request: Request) -> JSONResponse:
    arrival = time.perf_counter()
    state = get_state(request)
    served, scorer, engine = await _scorer(request, state, body.model)
    docs = body.document_texts()
    scores, num_tokens = await race_disconnect(request, _scores(served, scorer, engine,
                                                                [(body.query, d) for d in docs]))
    state.metrics.readout_done("rerank", arrival, {"documents": len(docs)}, served)
    if body.tei:
        return JSONResponse(wire.tei_response(docs, scores, body.top_n, bool(body.return_text)))
    # NOTE(server): Cohere's v2 leaves the documents out unless asked; Jina and vLLM return them
    default = request.url.path != "/v2/rerank"
    want = body.return_documents if body.return_documents is not None else default
    return JSONResponse(wire.rerank_response(docs, scores, served, num_tokens, body.top_n, want))


@router.post("/v1/score", summary="Score text pairs (vLLM's shape)")
@router.post("/score", include_in_schema=False)
async def score(body: wire.ScoreRequest, request: Request) -> JSONResponse:
    arrival = time.perf_counter()
    state = get_state(request)
    served, scorer, engine = await _scorer(request, state, body.model)
    pairs = body.pairs()
    scores, num_tokens = await race_disconnect(request, _scores(served, scorer, engine, pairs))
    state.metrics.readout_done("score", arrival, {"pairs": len(pairs)}, served)
    return JSONResponse(wire.score_response(scores, served, num_tokens))
