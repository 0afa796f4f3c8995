"""Ollama's native wire types (/api/chat, /api/generate, /api/embed) and their conversion to the OpenAI chat request the
engine run already takes (server.openai.protocol.ChatCompletionRequest), and back to Ollama's message shape.

Field names are Ollama's (docs/api.md of ollama/ollama); no onnxruntime import.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.types import InvalidRequestError
from server.openai.protocol import ChatCompletionRequest

# NOTE(ollama): the Ollama version /api/version reports: clients (Open WebUI, the ollama library) check for a
# recent one before using tools, think and structured outputs, all of which are served here.
OLLAMA_VERSION = "0.9.0"
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class Options(BaseModel):
    """The ``options`` a request may give (more are accepted and ignored, as Ollama ignores unknown ones)."""

    model_config = ConfigDict(extra="allow")

    temperature: float | None = None
    num_predict: int | None = None
    num_ctx: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: list[str] | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None  # not Ollama's own: Open WebUI's Ollama connection sends it on tool results


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | float | None = None
    think: bool | str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Common):
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    images: list[str] | None = None
    raw: bool = False
    template: str | None = None
    context: list[int] | None = None


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None
    options: Options | None = None
    keep_alive: str | float | None = None


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None  # older clients


def keep_alive_s(value: str | float | None) -> float | None:
    """Ollama's keep_alive (seconds as a number, or a Go duration such as "5m", "1h30m", "0", "-1") in seconds; a
    negative value keeps the model loaded for good (returned as -1)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return -1.0 if value < 0 else float(value)
    text = value.strip()
    try:
        number = float(text)
        return -1.0 if number < 0 else number
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.replace("+", ""):
        raise InvalidRequestError(f"keep_alive must be seconds or a duration such as 5m or 1h, got {value!r}",
                                  param="keep_alive", code="invalid_value")
    seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    return -1.0 if seconds < 0 else seconds


def _response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}
    raise InvalidRequestError(f"format must be \"json\" or a JSON schema, got {fmt!r}", param="format",
                              code="invalid_value")


def _sampling(options: Options | None) -> dict[str, Any]:
    if options is None:
        return {}
    fields = {"temperature": options.temperature, "seed": options.seed, "stop": options.stop or None,
              "top_p": options.top_p, "top_k": options.top_k, "min_p": options.min_p,
              "repetition_penalty": options.repeat_penalty, "presence_penalty": options.presence_penalty,
              "frequency_penalty": options.frequency_penalty}
    if options.num_predict is not None and options.num_predict >= 0:  # -1 (and -2): until the context ends
        fields["max_tokens"] = max(1, options.num_predict)
    return {key: value for key, value in fields.items() if value is not None}


def _thinking(think: bool | str | None) -> dict[str, Any]:
    if think is None:
        return {}
    if isinstance(think, str):  # "low" | "medium" | "high" (gpt-oss)
        return {"reasoning_effort": think, "chat_template_kwargs": {"enable_thinking": True}}
    return {"chat_template_kwargs": {"enable_thinking": think}}


def _openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: tool calls get ids (arguments as JSON text), a tool result is matched to the
    call its tool_call_id names (Open WebUI sends the call's id back), else to the last call of its tool."""
    out: list[dict[str, Any]] = []
    call_ids: dict[str, str] = {}
    every_id: set[str] = set()
    for i, message in enumerate(messages):
        if message.images:
            raise InvalidRequestError("images are not supported: the served models read text only",
                                      param=f"messages[{i}].images", code="invalid_value")
        item: dict[str, Any] = {"role": message.role, "content": message.content or ""}
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                function = call.get("function") or {}
                name, arguments = function.get("name", ""), function.get("arguments", {})
                call_id = call.get("id") or f"call_{i}_{j}"
                call_ids[name] = call_id
                every_id.add(call_id)
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
            item["tool_calls"] = calls
            if not item["content"]:
                item["content"] = None
        if message.role == "tool":
            name = message.tool_name or ""
            item["tool_call_id"] = (message.tool_call_id if message.tool_call_id in every_id else None) or \
                call_ids.get(name) or next(reversed(call_ids.values()), "call_0")
        out.append(item)
    return out


def _validated(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidRequestError(f"{where}: {first['msg']}", param=where or None, code="invalid_value") from None


def chat_to_openai(body: ChatRequest) -> ChatCompletionRequest:
    """/api/chat as the OpenAI chat request the engine run takes (streaming is Ollama's own, done by the route)."""
    if not body.messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages", code="invalid_value")
    request: dict[str, Any] = {"model": body.model, "messages": _openai_messages(body.messages),
                               **_sampling(body.options), **_thinking(body.think)}
    if body.tools:
        request["tools"] = body.tools
    if (fmt := _response_format(body.format)) is not None:
        request["response_format"] = fmt
    return _validated(request)


def generate_to_openai(body: GenerateRequest) -> ChatCompletionRequest:
    """/api/generate (not raw) as a chat request of the system and the prompt, in the model's template."""
    for name in ("suffix", "images", "template", "context"):
        if getattr(body, name):
            raise InvalidRequestError(f"{name} is not supported by this server's /api/generate", param=name,
                                      code="invalid_value")
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
        [{"role": "user", "content": body.prompt or ""}]
    request: dict[str, Any] = {"model": body.model, "messages": messages, **_sampling(body.options),
                               **_thinking(body.think)}
    if (fmt := _response_format(body.format)) is not None:
        request["response_format"] = fmt
    return _validated(request)


def created_at() -> str:
    """Ollama's timestamp: RFC 3339 with nanoseconds' place, UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ollama_tool_calls(tool_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI's tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    if not tool_calls:
        return None
    calls = []
    for index, call in enumerate(tool_calls):
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = {"_raw": function["arguments"]}
        calls.append({"function": {"index": index, "name": function["name"], "arguments": arguments}})
    return calls


def done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


def durations(started_ns: int, first_ns: int | None, load_s: float, num_prompt: int, num_generated: int
              ) -> dict[str, Any]:
    """The timing fields of a final message (nanoseconds, as Ollama gives them). The load (a first request's) is
    its own part of the total, not the prompt's: clients divide prompt_eval_count by prompt_eval_duration (Open
    WebUI's "prompt_token/s")."""
    now = time.perf_counter_ns()
    first = first_ns or now
    load_ns = min(int(load_s * 1e9), first - started_ns)  # a load that began before this request: the part it waited
    return {"total_duration": now - started_ns, "load_duration": load_ns,
            "prompt_eval_count": num_prompt, "prompt_eval_duration": max(0, first - started_ns - load_ns),
            "eval_count": num_generated, "eval_duration": max(0, now - first)}
