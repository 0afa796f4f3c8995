"""GET /metrics: Prometheus text format from this app's own registry."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.state import get_state

router = APIRouter(tags=["service"])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
@router.head("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    state = get_state(request)
    m = state.metrics
    stats, embedding = {}, {}
    for entry in state.registry.entries:  # every loaded model: its engine's snapshot under its name
        m.model_loaded.labels(entry.name).set(1 if entry.status == "ready" else 0)
        if entry.load_time_s is not None:
            m.model_load_seconds.labels(entry.name).set(entry.load_time_s)
        if entry.engine is not None:
            stats[entry.name] = entry.engine.stats()
        if entry.embedder is not None:
            embedding[entry.name] = entry.embedder.stats().num_requests
    body = m.render(stats, prefix_caching=state.settings.prefix_caching, num_embedding_requests=embedding)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
