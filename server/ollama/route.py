"""Ollama's native API, the subset its clients use: /api/version, /api/tags, /api/ps, /api/show, /api/chat and
/api/generate (NDJSON streams, or one JSON), /api/embed; /api/pull answers that models come from `ortserve pull`.

Requests become the OpenAI chat request (server.ollama.protocol) and run through the same preparation, engine run
and delta readers (tools, thinking) as /v1/chat/completions; only the framing is Ollama's.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.types import InvalidRequestError, PromptTooLongError
from server import __version__
from server.hub.catalog import folder_on_disk, resolve_kind
from server.hub.registry import OLLAMA_TAG, READY, ModelEntry
from server.http.prepare import PreparedChat, engine_for, prepare_chat, start_run, start_tracking
from server.errors import ModelNotFoundError, error_for
from server.http.run import EngineRun, StreamContext, check_error, collected
from server.ollama import protocol as wire
from server.openai.protocol import ChatCompletionRequest, finish_reason_str
from server.state import ServerState, get_state

router = APIRouter(tags=["ollama"])

_NDJSON = "application/x-ndjson"


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


@functools.lru_cache(maxsize=256)
def _folder_facts(folder: Path) -> tuple[int, str]:
    """A model folder's bytes on disk (its files, as Ollama's /api/tags ``size`` counts a model's blobs) and its
    architecture (genai_config.json's model type, or an encoder's embedding_config.json architecture). Read once:
    a served folder does not change."""
    size = sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
    family = ""
    for name, keys in (("genai_config.json", ("model", "type")), ("embedding_config.json", ("architecture",))):
        try:
            value: Any = json.loads((folder / name).read_text(encoding="utf-8"))
            for key in keys:
                value = value[key]
            family = str(value)
            break
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return size, family


def _facts(entry: ModelEntry) -> tuple[int, str]:
    """(bytes on disk, family) of an entry; (0, "") while its folder is not on disk yet (a known name not pulled,
    a GGUF not converted: its first load does that)."""
    folder = folder_on_disk(entry.model)
    return _folder_facts(folder) if folder is not None and folder.is_dir() else (0, "")


def _details(entry: ModelEntry) -> dict[str, Any]:
    family = _facts(entry)[1]
    return {"parent_model": "", "format": "onnx", "family": family, "families": [family] if family else None,
            "parameter_size": "", "quantization_level": ""}


def tagged(name: str) -> str:
    """A served name as Ollama names models, with a tag (":latest" unless it has one): Open WebUI adds ":latest"
    to a name without one and then looks it up among /api/tags' names."""
    return name if ":" in name else name + OLLAMA_TAG


def _model_item(state: ServerState, entry: ModelEntry) -> dict[str, Any]:
    return {"name": tagged(entry.name), "model": tagged(entry.name),
            "modified_at": wire.datetime.fromtimestamp(state.started_at, wire.timezone.utc).isoformat(),
            "size": _facts(entry)[0], "digest": "", "details": _details(entry)}


@router.get("/api/version", summary="Ollama: the version")
async def version() -> dict:
    return {"version": wire.OLLAMA_VERSION, "ortserve": __version__}


@router.get("/api/tags", summary="Ollama: the models this server serves")
async def tags(request: Request) -> dict:
    state = get_state(request)
    return {"models": [_model_item(state, e) for e in state.registry.entries]}


@router.get("/api/ps", summary="Ollama: the loaded models")
async def ps(request: Request) -> dict:
    state = get_state(request)
    models = []
    for entry in state.registry.entries:
        if entry.status != READY:
            continue
        expires = entry.expires_at(state.settings)
        item = _model_item(state, entry)
        item["size"] = entry.estimate_bytes  # Ollama's /api/ps size: the memory it holds (our estimate)
        item["expires_at"] = (wire.datetime.fromtimestamp(expires, wire.timezone.utc).isoformat() if expires
                              else "2318-01-01T00:00:00Z")  # never (Ollama's far date for keep_alive -1)
        item["size_vram"] = 0 if state.settings.provider in ("auto", "cpu") else entry.estimate_bytes
        item["context_length"] = entry.max_model_len()
        models.append(item)
    return {"models": models}


@router.post("/api/show", summary="Ollama: one model's details")
async def show(body: wire.ShowRequest, request: Request) -> dict:
    state = get_state(request)
    name = body.model or body.name or ""
    entry = state.registry.find(name)
    if entry is None:
        raise ModelNotFoundError(name, state.served_model_name, also=state.registry.served_names()[1:])
    # NOTE(ollama): resolve_kind: a known name's kind before its first load (its folder, hence entry.kind, comes then)
    capabilities = ["embedding"] if resolve_kind(entry.model) == "embedding" else ["completion", "tools"]
    template = getattr(getattr(entry.engine, "chat_template", None), "source", None) or ""
    info: dict[str, Any] = {}
    if entry.max_model_len():
        info["general.context_length"] = entry.max_model_len()
    return {"modelfile": f"FROM {entry.model.spec.model}\n", "parameters": "", "template": template,
            "details": _details(entry), "model_info": info, "capabilities": capabilities,
            "modified_at": _model_item(state, entry)["modified_at"]}


@router.post("/api/pull", summary="Ollama: pull (not served: use `ortserve pull`)")
@router.post("/api/push", include_in_schema=False)
@router.post("/api/create", include_in_schema=False)
@router.post("/api/copy", include_in_schema=False)
@router.delete("/api/delete", include_in_schema=False)
async def pull(request: Request) -> JSONResponse:
    return JSONResponse({"error": f"ortserve does not pull from Ollama's registry (nor create, copy or delete "
                                  f"models over its API): run `ortserve pull NAME` on the server, or serve a GGUF "
                                  f"file or model folder with --model, --models-dir or --config "
                                  f"(asked: {request.url.path})"}, status_code=400)


# --- generation -----------------------------------------------------------------------------------------------


async def _prepare(request: Request, chat: ChatCompletionRequest, options: wire.Options | None,
                   keep_alive: str | float | None) -> tuple[ServerState, Any, PreparedChat, ModelEntry]:
    keep = wire.keep_alive_s(keep_alive)
    state, engine = await engine_for(request, chat.model, keep)
    entry = request.state.ortserve_leases[-1]
    prepared = await prepare_chat(engine, state.settings, chat)
    if options is not None and options.num_ctx is not None:  # Ollama's context window, within the model's
        room = options.num_ctx - len(prepared.prompt_ids)
        if room < 1:
            raise PromptTooLongError(len(prepared.prompt_ids), options.num_ctx, param="messages")
        if prepared.params.max_tokens > room:
            from dataclasses import replace

            prepared = replace(prepared, params=replace(prepared.params, max_tokens=room))
    return state, engine, prepared, entry


async def _run(request: Request, state: ServerState, engine: Any, prepared: PreparedChat, kind: str
               ) -> tuple[EngineRun, StreamContext]:
    tracker = start_tracking(request, state)
    return await start_run(request, state, engine, tracker, f"ollama-{kind}", prepared.prompt_ids,
                           prepared.params, False)


async def _pieces(run: EngineRun, ctx: StreamContext, prepared: PreparedChat, timing: dict[str, Any]
                  ) -> AsyncIterator[tuple[str, str, dict[str, Any] | None]]:
    """(content, thinking, final) per engine output: the final one carries the whole message and the reason."""
    reader = prepared.delta_source()
    async for out in run.outputs():
        ctx.account(out)
        check_error(out)
        if timing.get("first_ns") is None:
            timing["first_ns"] = time.perf_counter_ns()
        done = out.finish_reason is not None
        content, thinking = [], []
        for delta in reader.feed(out.text, final=done):
            if delta.get("content"):
                content.append(delta["content"])
            if delta.get("reasoning_content"):
                thinking.append(delta["reasoning_content"])
        final = None
        if done:
            message = reader.message()
            final = {"reason": wire.done_reason(finish_reason_str(out.finish_reason)),
                     "tool_calls": wire.ollama_tool_calls(message.get("tool_calls"))}
        yield "".join(content), "".join(thinking), final


def _final_fields(ctx: StreamContext, entry: ModelEntry, timing: dict[str, Any], reason: str) -> dict[str, Any]:
    load_s = timing["load_s"]
    return {"done": True, "done_reason": reason,
            **wire.durations(timing["started_ns"], timing.get("first_ns"), load_s, ctx.num_prompt_tokens,
                             ctx.num_generated_tokens)}


def _respond(request: Request, run: EngineRun, ctx: StreamContext, prepared: PreparedChat, entry: ModelEntry,
             timing: dict[str, Any], stream: bool, chat: bool) -> Response | Any:
    """The NDJSON stream (or, not streamed, one JSON) of a chat or generate run."""

    def body(content: str, thinking: str, tool_calls: list | None) -> dict[str, Any]:
        head = {"model": ctx.model, "created_at": wire.created_at()}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {**head, "message": message}
        return {**head, "response": content, **({"thinking": thinking} if thinking else {})}

    if stream:
        async def lines() -> AsyncIterator[bytes]:
            try:
                async for content, thinking, final in _pieces(run, ctx, prepared, timing):
                    if final is None:
                        if content or thinking:
                            yield _line({**body(content, thinking, None), "done": False})
                        continue
                    if content or thinking:
                        yield _line({**body(content, thinking, None), "done": False})
                    yield _line({**body("", "", final["tool_calls"]),
                                 **_final_fields(ctx, entry, timing, final["reason"])})
            except Exception as exc:  # after the 200: Ollama ends the stream with an error line
                yield _line({"error": error_for(exc)[1]["error"]["message"]})
            finally:
                await run.close()

        return StreamingResponse(lines(), media_type=_NDJSON)

    async def gather() -> dict[str, Any]:
        contents, thoughts, last = [], [], None
        async for content, thinking, final in _pieces(run, ctx, prepared, timing):
            contents.append(content)
            thoughts.append(thinking)
            last = final or last
        assert last is not None
        return {**body("".join(contents), "".join(thoughts), last["tool_calls"]),
                **_final_fields(ctx, entry, timing, last["reason"])}

    return gather


def _timing(entry: ModelEntry, started_ns: int, loads_before: int) -> dict[str, Any]:
    loaded_now = entry.num_loads != loads_before and entry.load_time_s is not None
    return {"started_ns": started_ns, "load_s": entry.load_time_s if loaded_now else 0.0, "first_ns": None}


@router.post("/api/chat", summary="Ollama: chat (NDJSON stream by default)")
async def api_chat(body: wire.ChatRequest, request: Request) -> Response:
    started_ns = time.perf_counter_ns()
    state = get_state(request)
    before = _loads(state, body.model)
    chat = wire.chat_to_openai(body)
    if wire.keep_alive_s(body.keep_alive) == 0 and not body.messages:
        return await _unload_only(request, body.model, chat=True)
    state, engine, prepared, entry = await _prepare(request, chat, body.options, body.keep_alive)
    run, ctx = await _run(request, state, engine, prepared, "chat")
    reply = _respond(request, run, ctx, prepared, entry, _timing(entry, started_ns, before), body.stream, chat=True)
    if body.stream:
        return reply
    return JSONResponse(await collected(run, request, reply()))


@router.post("/api/generate", summary="Ollama: generate from a prompt (NDJSON stream by default)")
async def api_generate(body: wire.GenerateRequest, request: Request) -> Response:
    started_ns = time.perf_counter_ns()
    state = get_state(request)
    before = _loads(state, body.model)
    keep = wire.keep_alive_s(body.keep_alive)
    if not body.prompt and not body.system:
        # NOTE(ollama): an empty prompt loads the model (keep_alive 0: unloads it), as Ollama's clients use it
        if keep == 0:
            return await _unload_only(request, body.model, chat=False)
        await engine_for(request, body.model, keep)
        return JSONResponse({"model": body.model, "created_at": wire.created_at(), "response": "", "done": True,
                             "done_reason": "load"})
    if body.raw:
        raise InvalidRequestError("raw prompts are not supported here: use /v1/completions for a prompt without "
                                  "the chat template", param="raw", code="invalid_value")
    chat = wire.generate_to_openai(body)
    state, engine, prepared, entry = await _prepare(request, chat, body.options, body.keep_alive)
    run, ctx = await _run(request, state, engine, prepared, "generate")
    reply = _respond(request, run, ctx, prepared, entry, _timing(entry, started_ns, before), body.stream, chat=False)
    if body.stream:
        return reply
    return JSONResponse(await collected(run, request, reply()))


def _loads(state: ServerState, name: str) -> int:
    entry = state.registry.find(name)
    return entry.num_loads if entry is not None else 0


async def _unload_only(request: Request, name: str, chat: bool) -> JSONResponse:
    state = get_state(request)
    entry = state.registry.lookup(name, "chat")
    if entry.status == READY and not state.registry.fixed(entry):
        if entry.leases:
            entry.keep_alive_s = 0.0
        else:
            await state.registry.unload(entry)
    head = {"model": entry.name, "created_at": wire.created_at()}
    return JSONResponse({**head, **({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}),
                         "done": True, "done_reason": "unload"})


@router.post("/api/embed", summary="Ollama: embeddings")
async def api_embed(body: wire.EmbedRequest, request: Request) -> dict:
    from server.embeddings import protocol as embeddings_wire
    from server.embeddings.route import _dimensions, _embed

    started_ns = time.perf_counter_ns()
    state = get_state(request)
    before = _loads(state, body.model)
    entry = await state.acquire(request, body.model, "embedding", wire.keep_alive_s(body.keep_alive))
    request.state.ortserve_model, embedder = entry.name, entry.embedder
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    inputs = embeddings_wire.EmbeddingRequest(model=entry.name, input=texts).inputs()
    dims = _dimensions(embedder, body.dimensions)
    vectors, num_tokens = await _embed(state, entry.name, embedder, inputs,
                                       embedder.max_seq_length if body.truncate else None)
    if dims is not None:
        import numpy as np

        vectors = [v[:dims] / max(float(np.linalg.norm(v[:dims])), 1e-12) for v in vectors]
    load_s = entry.load_time_s if entry.num_loads != before and entry.load_time_s else 0.0
    return {"model": entry.name, "embeddings": [[float(x) for x in v] for v in vectors],
            "total_duration": time.perf_counter_ns() - started_ns, "load_duration": int(load_s * 1e9),
            "prompt_eval_count": num_tokens}
