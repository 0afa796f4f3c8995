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
    stats = state.engine.stats() if state.engine is not None else None
    embedding = sum(state.embedders[name].stats().num_requests for name in state.embedding_names())
    body = state.metrics.render(stats, model_name=state.served_model_name,
                                prefix_caching=state.settings.prefix_caching, num_embedding_requests=embedding)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
