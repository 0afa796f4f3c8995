"""Anthropic Messages API wire format: the request models, their conversion to a chat request, the response
objects and the error shape.

A Messages request becomes a ChatCompletionRequest (system + messages -> chat messages, tools -> function tools,
tool_choice and output_config.format -> their chat fields), so prompt building, tool grammars and reasoning are
the chat path's; server/anthropic/events.py turns the chat deltas back into content blocks and stream events.
Must not import onnxruntime or any engine module other than engine.types.
"""

from __future__ import annotations

import json
import logging
import uuid
from contextlib import AbstractContextManager
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from engine.types import InvalidRequestError, PromptTooLongError
from server.openai.base import OpenAIBaseModel
from server.openai.protocol import (ChatCompletionRequest, chat_request_from, param_renamer,
                                    renamed_errors)

logger = logging.getLogger(__name__)

# Routes whose errors take Anthropic's shape.
ANTHROPIC_PATH_PREFIX = "/v1/messages"
# Fields that do not apply to a local model: accepted, logged at debug level, ignored.
IGNORED_FIELDS = ("metadata", "context_management", "service_tier", "cache_control", "container", "mcp_servers",
                  "inference_geo", "speed", "diagnostics")
# ortserve's sampling extensions on chat, passed through unchanged (same names, same ranges).
SAMPLING_EXTRAS = ("min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
                   "structured_outputs")
# Chat parameter -> the Messages field it came from (errors name what the client sent).
_PARAM_NAMES = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "stop": "stop_sequences",
                "response_format": "output_config.format", "prompt": "messages"}
# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
                503: "overloaded_error", 529: "overloaded_error"}
# Blocks a local text model has no use for (images, documents, server tools' results, ...) are skipped.
_TEXT_BLOCKS = ("text",)
# Claude Code's first system block: billing metadata for Anthropic's API (its version, and in some versions a
# per-request stamp), not words for the model.
_BILLING_HEADER = "x-anthropic-billing-header:"


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_openai_error(status: int, body: dict[str, Any], exc: BaseException | None = None) -> dict[str, Any]:
    """An OpenAI error body (server.errors builds them) in Anthropic's shape. A prompt too long for the context
    says so in Anthropic's words first (``prompt is too long: N tokens > M maximum``), which clients such as
    Claude Code recognise."""
    message = str((body.get("error") or {}).get("message") or "error")
    if isinstance(exc, PromptTooLongError):
        message = f"prompt is too long: {exc.num_prompt_tokens} tokens > {exc.max_model_len} maximum ({message})"
    return error_body(status, message)


def new_id(prefix: str) -> str:
    """``msg_`` / ``toolu_`` and 24 hex digits, as Anthropic's ids look."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


messages_param = param_renamer(_PARAM_NAMES)
"""The Messages field a chat parameter came from."""


def as_messages_errors() -> AbstractContextManager[None]:
    """Rename the `param` of InvalidRequestErrors raised by the chat path to the Messages field names."""
    return renamed_errors(messages_param)


def _invalid(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param, code=code)


# --- content blocks -> chat messages -------------------------------------------------------------------------


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise _invalid(f"a content block must be an object, got {type(block).__name__}", where, "invalid_type")
    if not isinstance(block.get("text"), str):
        raise _invalid("a text block needs a string 'text'", f"{where}.text", "invalid_type")
    return block["text"]


def _skip(kind: Any, where: str) -> None:
    logger.warning("messages: skipping a %r content block at %s (this server reads text, tool_use, tool_result "
                   "and thinking blocks)", kind, where)


def _result_text(content: Any, where: str) -> str:
    """A tool_result's content: a string, or blocks whose text parts are joined (others skipped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid("must be a string or a list of content blocks", where, "invalid_type")
    texts = []
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _TEXT_BLOCKS:
            texts.append(_block_text(block, f"{where}[{index}]"))
        else:
            _skip(kind, f"{where}[{index}]")
    return "\n".join(texts)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _invalid("must be a string or a list of content blocks", where, "invalid_type")
    for index, block in enumerate(content):
        if not isinstance(block, dict):
            raise _invalid(f"a content block must be an object, got {type(block).__name__}", f"{where}[{index}]",
                           "invalid_type")
    return content


class _Conversation:
    """Builds the chat messages of one request: consecutive turns of a role merge (as Anthropic merges them), a
    system message inside ``messages`` joins the system prompt while nothing else came before it, and otherwise
    the text of the user turn it sits in (chat templates take a system message only at the start)."""

    def __init__(self, system: str) -> None:
        self.system = system
        self.messages: list[dict[str, Any]] = []

    def _last(self, role: str) -> dict[str, Any] | None:
        last = self.messages[-1] if self.messages else None
        return last if last is not None and last["role"] == role and not last.get("tool_calls") else None

    def text(self, role: str, text: str) -> None:
        if role == "system" and not self.messages:
            self.system = "\n\n".join(t for t in (self.system, text) if t)
            return
        role = "user" if role == "system" else role
        last = self._last(role)
        if last is not None:
            last["content"] = "\n\n".join(t for t in (last["content"], text) if t)
        else:
            self.messages.append({"role": role, "content": text})

    def assistant(self, text: str, calls: list[dict[str, Any]], thinking: str) -> None:
        last = self._last("assistant")
        if last is not None and not calls and not thinking:
            last["content"] = "\n\n".join(t for t in (last["content"], text) if t)
            return
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = thinking
        self.messages.append(message)

    def tool_result(self, call_id: str, text: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def chat(self) -> list[dict[str, Any]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages


# --- the request ---------------------------------------------------------------------------------------------


class MessageParam(OpenAIBaseModel):
    """One turn: role and content (a string or content blocks, read by MessagesRequest)."""

    role: str = Field(description="'user' or 'assistant' ('system' is taken as Anthropic's API takes it).")
    content: str | list[Any] = Field(description="A string or a list of content blocks.")

    @field_validator("role")
    @classmethod
    def _check_role(cls, value: str) -> str:
        if value not in ("user", "assistant", "system"):
            raise InvalidRequestError(f"role must be 'user' or 'assistant', got {value!r}", code="invalid_value")
        return value


class ToolParam(OpenAIBaseModel):
    """A client tool: name, description and the JSON Schema of its input."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    strict: bool | None = Field(None, description="true: calls follow input_schema exactly, or the request is a 400 "
                                                  "naming what cannot be enforced.")


class ThinkingConfig(OpenAIBaseModel):
    type: str = Field(description="'enabled', 'adaptive' or 'disabled'; 'disabled' tells templates that think "
                                  "to skip it (enable_thinking false).")
    budget_tokens: int | None = None


class _MessagesFields(OpenAIBaseModel):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    model: str = Field(description="The served model name (see GET /v1/models).")
    messages: list[MessageParam] = Field(description="The conversation so far; at least one message.")
    system: str | list[Any] | None = Field(None, description="The system prompt: a string or text blocks.")
    tools: list[Any] | None = Field(None, description="Client tools ({name, description, input_schema}).")
    tool_choice: dict[str, Any] | None = Field(None, description="{'type': 'auto' | 'any' | 'tool' (with name) | "
                                               "'none'}, optional disable_parallel_tool_use.")
    thinking: ThinkingConfig | None = None
    output_config: dict[str, Any] | None = Field(None, description="`format` (a json_schema output) and `effort` "
                                                 "(reasoning_effort for templates that take it).")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="More chat template variables.")

    @model_validator(mode="after")
    def _check_fields(self) -> _MessagesFields:
        if not self.messages:
            raise InvalidRequestError("messages: at least one message is required", param="messages",
                                      code="invalid_value")
        ignored = sorted(k for k in (self.model_extra or {}) if k in IGNORED_FIELDS)
        if ignored:
            logger.debug("messages: ignoring fields that do not apply to this server: %s", ignored)
        return self

    def _system_text(self) -> str:
        """The system prompt's text blocks, joined. NOTE(messages): a block that is Claude Code's billing header
        is left out, as Anthropic's API reads it instead of the model: the model never sees it, and a prompt that
        starts with a per-version (or per-request) stamp would defeat prefix reuse (llama.cpp's server blanks
        that stamp for the same reason)."""
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        texts = (_block_text(block, f"system[{i}]") for i, block in enumerate(self.system))
        return "\n\n".join(t for t in texts if not t.startswith(_BILLING_HEADER))

    def _conversation(self) -> tuple[list[dict[str, Any]], bool]:
        """The chat messages, and whether the answer continues a final assistant message (a prefill)."""
        conversation = _Conversation(self._system_text())
        for index, message in enumerate(self.messages):
            where = f"messages[{index}].content"
            blocks = _blocks(message.content, where)
            if message.role == "assistant":
                texts, calls, thinking = [], [], []
                for b, block in enumerate(blocks):
                    kind = block.get("type")
                    if kind == "text":
                        texts.append(_block_text(block, f"{where}[{b}]"))
                    elif kind == "tool_use":
                        calls.append(_tool_call(block, f"{where}[{b}]"))
                    elif kind == "thinking" and isinstance(block.get("thinking"), str):
                        thinking.append(block["thinking"])
                    elif kind != "redacted_thinking":  # encrypted for Anthropic's servers: nothing to read
                        _skip(kind, f"{where}[{b}]")
                conversation.assistant("".join(texts), calls, "\n".join(thinking))
                continue
            for b, block in enumerate(blocks):
                kind = block.get("type")
                if kind == "text":
                    conversation.text(message.role, _block_text(block, f"{where}[{b}]"))
                elif kind == "tool_result" and message.role == "user":
                    call_id = block.get("tool_use_id")
                    if not isinstance(call_id, str) or not call_id:
                        raise _invalid("a tool_result needs the tool_use_id of the call it answers",
                                       f"{where}[{b}].tool_use_id", "missing_required_parameter")
                    text = _result_text(block.get("content"), f"{where}[{b}].content")
                    conversation.tool_result(call_id, f"Error: {text}" if block.get("is_error") else text)
                else:
                    _skip(kind, f"{where}[{b}]")
        chat = conversation.chat()
        last = chat[-1]
        prefill = last["role"] == "assistant" and not last.get("tool_calls")
        if prefill and not last["content"]:
            chat.pop()  # an empty assistant turn at the end: nothing to continue
            prefill = False
        elif prefill and last["content"] != last["content"].rstrip():
            raise InvalidRequestError("messages: final assistant content cannot end with trailing whitespace",
                                      param="messages", code="invalid_value")
        if not any(m["role"] != "system" for m in chat):
            raise InvalidRequestError("messages: at least one user or assistant message with content is required",
                                      param="messages", code="invalid_value")
        return chat, prefill

    def _tools(self) -> tuple[list[dict[str, Any]], set[str]]:
        """Chat function tools, and the names of tools skipped (Anthropic-defined and server tools, which come
        with no input schema this server could enforce).

        NOTE(messages): a tool with ``defer_loading`` is not shown to the model, as on Anthropic's API, where it
        enters the context only once a tool search finds it (Claude Code sends a DeferredToolPlaceholder that way:
        "never call this tool"); unless tool_choice names it.
        """
        tools, skipped = [], set()
        forced = (self.tool_choice or {}).get("name") if (self.tool_choice or {}).get("type") == "tool" else None
        for index, data in enumerate(self.tools or []):
            where = f"tools[{index}]"
            if not isinstance(data, dict):
                raise _invalid("a tool must be an object", where, "invalid_type")
            if data.get("defer_loading") is True and data.get("name") != forced:
                logger.debug("messages: not showing the deferred tool %r to the model", data.get("name"))
                continue
            kind = data.get("type")
            if kind not in (None, "custom") or "input_schema" not in data:
                skipped.add(str(data.get("name") or kind))
                continue
            tool = _typed_tool(data, where)
            function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            if tool.strict is not None:
                function["strict"] = tool.strict
            tools.append({"type": "function", "function": function})
        if skipped:
            logger.warning("messages: skipping tools this server cannot run (Anthropic-defined and server tools "
                           "have no input_schema): %s", sorted(skipped))
        return tools, skipped

    def _tool_fields(self, body: dict[str, Any]) -> None:
        tools, skipped = self._tools()
        choice = self.tool_choice or {"type": "auto"}
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise _invalid(f"type must be 'auto', 'any', 'tool' or 'none', got {kind!r}", "tool_choice.type")
        if kind == "tool":
            name = choice.get("name")
            if not isinstance(name, str):
                raise _invalid("a 'tool' choice needs the name of one of the tools", "tool_choice.name",
                               "missing_required_parameter")
            if name in skipped:
                raise _invalid(f"the tool {name!r} cannot be forced: this server does not run it",
                               "tool_choice.name", "unsupported_tool_type")
        if not tools:
            if kind in ("any", "tool"):
                raise _invalid(f"a {kind!r} tool choice needs tools", "tool_choice.type")
            return
        body["tools"] = tools
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            kind, {"type": "function", "function": {"name": choice.get("name")}})
        if choice.get("disable_parallel_tool_use") is True:
            body["parallel_tool_calls"] = False

    def chat_body(self) -> dict[str, Any]:
        """The chat request's fields for this prompt (no sampling)."""
        messages, prefill = self._conversation()
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if prefill:
            body["continue_final_message"], body["add_generation_prompt"] = True, False
        self._tool_fields(body)
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None and self.thinking.type == "disabled":
            kwargs.setdefault("enable_thinking", False)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        output = self.output_config or {}
        if isinstance(output.get("effort"), str):
            body["reasoning_effort"] = output["effort"]
        response_format = _response_format(output.get("format"))
        if response_format is not None:
            body["response_format"] = response_format
        return body

    def to_chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The chat request this Messages request stands for; InvalidRequestError naming the Messages field."""
        return chat_request_from({**self.chat_body(), **sampling}, messages_param, "messages")


def _typed_tool(data: dict[str, Any], where: str) -> ToolParam:
    try:
        tool = ToolParam.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()) if isinstance(p, str))
        raise _invalid(str(first.get("msg", "invalid value")), f"{where}.{field}" if field else where,
                       "invalid_type") from None
    if tool.input_schema is None:
        raise _invalid("input_schema is required", f"{where}.input_schema", "missing_required_parameter")
    return tool


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool_use block of the history as a chat tool call (input -> arguments as JSON text)."""
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise _invalid("a tool_use block needs a string id and name", where, "invalid_type")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _response_format(spec: Any) -> dict[str, Any] | None:
    """output_config.format -> chat response_format ({"type": "json_schema", "schema"} -> json_schema)."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise _invalid("format must be {'type': 'json_schema', 'schema': {...}}", "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"], "strict": True}}


class MessagesRequest(_MessagesFields):
    """POST /v1/messages."""

    max_tokens: int = Field(description="Most tokens to generate (>= 1); more than the context leaves is served "
                                        "up to the context (stop_reason max_tokens).")
    stop_sequences: list[str] | None = Field(None, description="Strings that end the answer (stop_reason "
                                             "stop_sequence; never part of the text).")
    stream: bool = Field(False, description="Stream the answer as server-sent events (message_start ... "
                                            "message_stop).")
    temperature: float | None = Field(None, description="Sampling temperature; 0 is greedy. Default 1.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1].")
    top_k: int | None = Field(None, description="Keep the k most likely tokens.")

    @model_validator(mode="after")
    def _check_sampling(self) -> MessagesRequest:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens: must be >= 1, got {self.max_tokens}", param="max_tokens",
                                      code="invalid_value")
        return self

    def to_chat(self) -> ChatCompletionRequest:
        sampling: dict[str, Any] = {"max_completion_tokens": self.max_tokens, "stream": self.stream}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                sampling[name] = getattr(self, name)
        if self.stop_sequences:
            sampling["stop"] = self.stop_sequences
        for name in SAMPLING_EXTRAS:
            if name in (self.model_extra or {}):
                sampling[name] = self.model_extra[name]  # type: ignore[index]
        return self.to_chat_request(**sampling)


class CountTokensRequest(_MessagesFields):
    """POST /v1/messages/count_tokens: the prompt of a Messages request, counted, nothing generated."""


# --- response objects ----------------------------------------------------------------------------------------


def usage(num_prompt_tokens: int, num_generated_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache (prefix reuse gives
    ``cache_read_input_tokens``; their sum is the prompt)."""
    return {"input_tokens": num_prompt_tokens - num_cached_tokens, "output_tokens": num_generated_tokens,
            "cache_read_input_tokens": num_cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(finish_reason: str | None, stop_string: str | None, made_calls: bool) -> str | None:
    """The chat finish_reason (+ the stop string that ended it, + whether the answer called tools) as
    Anthropic's stop_reason."""
    if finish_reason is None:
        return None
    if finish_reason == "length":
        return "max_tokens"
    if stop_string is not None:
        return "stop_sequence"
    return "tool_use" if made_calls else "end_turn"


def message_object(message_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
                   stop_sequence: str | None, usage_dict: dict[str, Any],
                   metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Message (``metrics`` beside its usage: --per-request-spec-decode-metrics)."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage_dict,
            **({"metrics": metrics} if metrics is not None else {})}
