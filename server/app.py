"""create_app(settings, engine=None): the FastAPI app, its lifespan (engine loading and shutdown) and middleware.

The engine lives on app.state.ortserve, a server.state.ServerState (no module globals). Imports the engine
package only lazily, inside the loader, so importing the app never loads onnxruntime.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from ep.profiles import DEVICE_SWITCH_INTERVAL_MS  # noqa: F401 - a model on a device (the profiles' default)
from server.engine_client import EmbedderClient, EngineClient
from server.errors import install_error_handlers
from server.http.security import AuthMiddleware, BodyLimitMiddleware
from server.settings import Settings
from server.hub.catalog import format_bytes
from server.hub.registry import READY, LeaseMiddleware
from server.state import ServerState, serves_one_model

logger = logging.getLogger("ortserve")

EngineLoader = Callable[[Settings], EngineClient]
# NOTE(server): what a multipart upload carries beside the file (its boundaries and the purpose field), at most
UPLOAD_FORM_BYTES = 64 * 1024
EmbeddingLoader = Callable[[Settings, Any], EmbedderClient]


def engine_config_from(settings: Settings, draft_model_dir: Any = None) -> Any:
    """The engine's EngineConfig for these settings (imports the engine package); ``draft_model_dir``: the resolved
    --draft-model folder (None: no draft model)."""
    from engine.config import EngineConfig

    kwargs: dict[str, Any] = {
        "provider": settings.provider,
        "device": settings.device,
        "ep_library": settings.ep_library,
        "ep_options": settings.ep_options(),
        "max_batch": settings.max_batch,
        "max_queue": settings.max_queue,
        "max_model_len": settings.max_model_len,
        "kv_cache_memory_gib": settings.kv_cache_memory_gib,
        "intra_op_threads": settings.intra_op_threads,
        "graph_capture": settings.graph_capture,
        "device_row_summary": settings.device_row_summary,
        "one_row_session": settings.one_row_session,
        "batched_prompts": settings.batched_prompts,
        "batched_prompt_tokens": settings.batched_prompt_tokens,
        "chat_template": settings.chat_template,
        "grammar_compile_timeout_s": settings.grammar_compile_timeout_s,
        "prefix_caching": settings.prefix_caching,
        "max_prefills_per_step": settings.max_prefills_per_step,
        "engine_process": settings.engine_process,
        # NOTE(hub): a hub loads models beside running streams; a one-model server's load is the server's start
        "load_nice": 0 if serves_one_model(settings) else settings.load_nice,
        "step_trace": settings.step_trace,
    }
    if settings.prefill_chunk is not None:
        kwargs["prefill_chunk"] = settings.prefill_chunk
    if settings.speculative_tokens is not None:
        kwargs["speculative_tokens"] = settings.speculative_tokens
    if draft_model_dir is not None:
        kwargs.update(draft_model=str(draft_model_dir), draft_max=settings.draft_max,
                      draft_min=min(settings.draft_min, settings.draft_max), draft_p_min=settings.draft_p_min)
    return EngineConfig(**kwargs)


def load_engine(settings: Settings) -> EngineClient:
    """Resolve `settings.model` to a model folder and load an AsyncEngine on it (blocking; run in a thread).

    Args:
        settings: uses model, provider, device, ep_library, ep_option and the scheduling bounds.

    Returns:
        The loaded engine.
    """
    from engine.async_engine import AsyncEngine
    from engine.builder import resolve_model

    model_dir = resolve_model(settings.model)
    draft_dir = resolve_model(settings.draft_model, requant=settings.draft_requant) if settings.draft_model else None
    return AsyncEngine.from_model_dir(model_dir, engine_config_from(settings, draft_dir))


def _tune_interpreter(settings: Settings, engine: Any) -> None:
    """Once the model is loaded: freeze the heap and set the thread switch interval.

    NOTE(server): everything alive by now (modules, the tokenizer, the app, the engine: ~130k objects) lives as long
    as the process, and every full collection scanned it all (350 ms on a loaded 2-core machine, tens of ms on a
    fast one), stalling every stream at once while requests churned objects; ``gc.freeze()`` moves it to the
    permanent generation, as vLLM does after startup.
    """
    gc.collect()
    gc.freeze()
    interval = settings.gil_switch_interval_ms
    placement = getattr(engine, "placement", None)
    if interval is None and placement is not None:  # the device profile's (engine.types.DevicePlacement)
        interval = placement.switch_interval_ms
    if interval is not None:
        sys.setswitchinterval(interval / 1000)
    logger.info("interpreter: %d objects frozen, switch interval %.2f ms", gc.get_freeze_count(),
                sys.getswitchinterval() * 1000)


def load_embedder(settings: Settings, model: Any) -> EmbedderClient:
    """The embedding engine of one catalog model (blocking; run in a thread): an embedding model's own (its own
    session and thread, the pooling it was trained with; in a hub, in an engine process of its own), or, for a chat
    model served with ``--embeddings``, its embedding graph pooled by ``--pooling`` (here, beside the chat model's).

    Args:
        settings: the model's settings (``model`` is its folder).
        model: the server.hub.catalog.CatalogModel.
    """
    from engine.embedding import EmbeddingConfig, EmbeddingEngine

    pooling = settings.pooling if model.kind == "chat" else None
    config = EmbeddingConfig(provider="cpu" if settings.provider in ("auto", "cpu") else settings.provider,
                             intra_op_threads=settings.intra_op_threads, max_queue=settings.embedding_max_queue,
                             max_batch_tokens=settings.embedding_batch_tokens, pooling=pooling,
                             nice=settings.embedding_nice)
    if model.kind == "embedding" and model.extra.get("engine_process"):  # a hub's embedding model
        from engine.embedding_process import EmbeddingProcessClient

        return EmbeddingProcessClient(model.folder, config)
    return EmbeddingEngine.from_model_dir(model.folder, config)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.ortserve
    registry = state.registry
    load_task: asyncio.Task | None = None
    lag_task: asyncio.Task | None = None
    loop_trace = None

    async def load() -> None:
        """The pinned models (a one-model server's model and embedding model) before the server is ready."""
        nonlocal lag_task, loop_trace
        for entry in registry.entries:
            if not entry.model.pinned or entry.status == READY or state.status == "stopping":
                continue
            # NOTE(server): loading takes seconds to minutes (conversion, session creation); a thread
            # keeps the loop serving /health (503 "loading") meanwhile.
            await registry.load(entry)
            if entry.status != READY and registry.one_model:
                state.status, state.load_error = "failed", entry.load_error
                if state.on_load_failed is not None:
                    state.on_load_failed(state.load_error or "")
                return
        if state.status == "stopping":  # shut down while loading: the lifespan's finally shuts it down
            return
        await registry.start()
        if state.before_ready is not None:
            await anyio.to_thread.run_sync(state.before_ready)
        state.status = "ready"
        engine = state.engine
        _tune_interpreter(state.settings, engine)
        if state.settings.step_trace:  # NOTE(server): the loop's late wake-ups beside the engine's steps
            from engine.step_trace import TraceFile, watch_loop

            # the engine's own trace records this process's collections when the core runs here
            loop_trace = TraceFile(state.settings.step_trace, "server",
                                   collections=bool(getattr(engine, "engine_process", False)))
            lag_task = asyncio.create_task(watch_loop(loop_trace))
        if engine is not None:
            logger.info("model %s ready (max_model_len %d)%s", state.served_model_name, engine.max_model_len,
                        f"; embeddings: {', '.join(state.embedding_names())}" if state.embedders else "")
        if not registry.one_model:
            logger.info("serving %d models: %s (each loads on its first request; memory budget %s, from %s)",
                        len(registry.entries), ", ".join(registry.served_names()),
                        format_bytes(registry.budget_bytes or 0), registry.budget_source)

    await state.store.start()
    jobs_task = asyncio.create_task(_start_jobs(state))
    if state.status != "ready" and (registry.chat_loader is not None or not registry.one_model):
        load_task = asyncio.create_task(load())
    try:
        yield
    finally:
        state.status = "stopping"
        jobs_task.cancel()
        await state.jobs.stop()
        if load_task is not None and not load_task.done():
            await asyncio.wait({load_task}, timeout=None)  # a half-loaded session cannot be cancelled
        if lag_task is not None:
            lag_task.cancel()
            await asyncio.gather(lag_task, return_exceptions=True)
        if loop_trace is not None:
            loop_trace.close()
        logger.info("shutting the engines down")
        await registry.stop()
        await state.store.close()


async def _start_jobs(state: ServerState) -> None:
    """Once the server is ready: run this process's background responses and batches, and take over those of
    processes that died (server.jobs)."""
    from server.batches.runner import run_batch
    from server.responses.background import resume_response

    while state.status != "ready":
        if state.status in ("failed", "stopping"):
            return
        await asyncio.sleep(0.1)
    state.jobs.start({"responses": partial(resume_response, state), "batches": partial(run_batch, state)})


def create_app(settings: Settings, engine: EngineClient | None = None, *,
               loader: EngineLoader | None = load_engine,
               embedders: dict[str, EmbedderClient] | None = None,
               embedding_loader: EmbeddingLoader | None = load_embedder) -> FastAPI:
    """The ortserve FastAPI app.

    Args:
        settings: server settings (auth, limits, CORS, model name, ...).
        engine: an already loaded engine (tests, embedding); the app then never shuts it down.
            None: the lifespan loads one with `loader(settings)` in a thread.
        loader: how to load the engine when none is given; None leaves the app "loading" forever
            (unit tests of validation that need no model).
        embedders: already loaded embedding engines by name (with ``engine``); the app never shuts them down.
        embedding_loader: loads one model's embedding engine (``load_embedder``): a one-model server's
            --embedding-model and --embeddings before it reports ready, a hub's embedding models on demand.

    Returns:
        The app; run it with uvicorn. `/health` answers 503 until the engine is ready.
    """
    from server import __version__
    from server.anthropic import route as messages
    from server.batches import route as batches
    from server.conversations import route as conversations
    from server.files import route as files
    from server.decisions import route as decisions
    from server.embeddings import route as embeddings
    from server.http.prepare import refuse_uncontainable_chat
    from server.hub import admin
    from server.ollama import route as ollama
    from server.openai import chat, completions, models
    from server.rerank import route as rerank
    from server.responses import route as responses
    from server.responses import websocket as responses_socket
    from server.routes import health, metrics
    from server.tokenize import route as tokenize

    app = FastAPI(
        title="ortserve",
        version=__version__,
        description="OpenAI-compatible LLM server on ONNX Runtime.",
        lifespan=_lifespan,
    )
    state = ServerState(settings=settings)
    registry = state.registry
    registry.chat_loader = loader if engine is None or not registry.one_model else None
    registry.embedder_loader = embedding_loader
    if engine is not None:
        state.engine, state.status = engine, "ready"
    if embedders:
        state.add_embedders(embedders)
    if engine is not None and registry.one_model:
        for entry in registry.entries:  # an app given its engine never loads another (the old contract)
            entry.model.pinned = True
    registry.on_unload.append(lambda entry: state.metrics.forget_model(entry.name))
    app.state.ortserve = state
    state.app = app
    app.state.ortserve_body_check = partial(refuse_uncontainable_chat, state)

    install_error_handlers(app)
    for module in (chat, completions, responses, responses_socket, conversations, files, batches, messages, tokenize, embeddings,
                   decisions, rerank, models, health, metrics, admin, ollama):
        app.include_router(module.router)
    if settings.ui:
        from server.routes.ui import install_ui

        install_ui(app)

    # Middleware: the last added runs first. Order seen by a request: CORS -> auth -> body limit -> leases.
    app.add_middleware(LeaseMiddleware, registry=lambda: state.registry)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_timeout_s,
                       upload_paths={"/v1/files": settings.file_max_bytes + UPLOAD_FORM_BYTES})
    app.add_middleware(AuthMiddleware, api_key=settings.api_key_value(),
                       open_paths=_open_paths(settings))
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["*"],  # SDKs send their own headers (x-stainless-*, openai-*, anthropic-*)
        )
    return app


def _open_paths(settings: Settings) -> frozenset[str]:
    """Paths that never need the API key: /health, the chat page's static files (it asks for the key itself),
    and /metrics unless asked (issue 8: the key covers every other endpoint, the API description included)."""
    paths = {"/health"}
    if settings.ui:
        from server.routes.ui import ui_paths

        paths |= ui_paths()
    if not settings.metrics_require_key:
        paths.add("/metrics")
    return frozenset(paths)
