"""OpenAI Responses API wire format: the request model, its conversion to a chat request, and response builders.

A Responses request becomes a ChatCompletionRequest (input items and instructions -> chat messages, function
tools -> chat tools, text.format -> response_format), so prompt building, tools and structured output are the
chat path's. Output items, usage and the streamed events are built here (server/responses.py assembles them).
Must not import onnxruntime or any engine module other than engine.types.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from server.openai.base import IdleTTLField, OpenAIBaseModel
from server.openai.protocol import (ChatCompletionRequest, chat_request_from, param_renamer,
                                    renamed_errors)
from server.responses.tools import FunctionTool, ToolNames, allowed_names, chat_tool_choice, function_tools
from server.responses.tools import invalid as _invalid
from server.responses.tools import typed as _typed

logger = logging.getLogger(__name__)

# Fields of the Responses API that do not apply to a local model: accepted, logged and ignored.
IGNORED_FIELDS = ("include", "truncation", "service_tier", "top_logprobs", "max_tool_calls",
                  "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
                  "context_management", "stream_options", "client_metadata")
# ortserve's sampling extensions on chat, passed through unchanged (same names, same ranges).
SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "ignore_eos", "chat_template_kwargs", "structured_outputs")
# Chat parameter -> the Responses parameter it came from (errors name what the client sent).
_PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format", "prompt": "input"}
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_METADATA_MAX_PAIRS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: ``resp_``, ``msg_``, ``fc_`` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


responses_param = param_renamer(_PARAM_NAMES)
"""The Responses field a chat parameter came from ('messages[2].content' -> 'input')."""


def as_responses_errors() -> AbstractContextManager[None]:
    """Rename the `param` of InvalidRequestErrors raised by the chat path to the Responses field names."""
    return renamed_errors(responses_param)


# --- input items ------------------------------------------------------------------------------------


def _part_text(part: Any, param: str) -> str:
    """The text of one content part; images, files and audio are refused naming the part's type."""
    if not isinstance(part, dict):
        raise _invalid(f"{param} must be an object, got {type(part).__name__}", param, "invalid_type")
    kind = part.get("type")
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind not in _TEXT_PARTS:
        raise _invalid(f"content part type {kind!r} is not supported: ortserve serves text models "
                       f"(parts of type {', '.join(repr(t) for t in _TEXT_PARTS[:2])} only)",
                       f"{param}.type", "unsupported_content_type")
    if not isinstance(part.get("text"), str):
        raise _invalid(f"{param}.text must be a string", f"{param}.text", "invalid_type")
    return part["text"]


def _content_text(content: str | list[Any], param: str) -> str:
    """String content, or text parts joined by a newline (as the chat path joins them, and vLLM and llama.cpp)."""
    if isinstance(content, str):
        return content
    return "\n".join(_part_text(part, f"{param}[{index}]") for index, part in enumerate(content))


class MessageItem(OpenAIBaseModel):
    """{"role", "content"} (an "easy" input message) or an output message sent back as input."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Any]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(OpenAIBaseModel):
    """A call the model made earlier (sent back as input, or from a stored response); ``namespace`` names the
    namespace tool the function belongs to."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class ReasoningItem(OpenAIBaseModel):
    """Thinking the model did earlier, sent back as input: its text (``content`` parts of type reasoning_text,
    else the summary) goes to the next assistant message. ``encrypted_content`` is accepted and unused (this
    server never encrypts it)."""

    type: Literal["reasoning"]
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


class FunctionCallOutputItem(OpenAIBaseModel):
    """The client's result of a function call: `output` is a string or a list of text parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Any]
    id: str | None = None
    status: str | None = None


# NOTE(server): what starts the ``encrypted_content`` of the compaction items this server makes (POST
# /v1/responses/compact): the summary follows as plain text. Compaction items of other servers are encrypted for
# them, and carry nothing this model can read.
COMPACTION_PREFIX = "ortserve-summary:v1:"


class CompactionItem(OpenAIBaseModel):
    """A compacted conversation sent back as input (Codex keeps the items POST /v1/responses/compact returned)."""

    type: Literal["compaction", "compaction_summary"]
    encrypted_content: str | None = None
    id: str | None = None

    @property
    def summary(self) -> str | None:
        """The summary this server wrote (None: another server's, encrypted)."""
        content = self.encrypted_content or ""
        return content[len(COMPACTION_PREFIX):] if content.startswith(COMPACTION_PREFIX) else None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | CompactionItem
_ITEM_MODELS: dict[str, type[OpenAIBaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem, "compaction": CompactionItem, "compaction_summary": CompactionItem,
}
# Item types a client may send back that carry nothing a local model uses (its web searches ran elsewhere).
_DROPPED_ITEMS = ("web_search_call", "item_reference")


def parse_items(raw: Sequence[Any], param: str = "input") -> list[InputItem]:
    """Typed input items; item types other than messages and function calls/outputs are a 400 naming them."""
    items: list[InputItem] = []
    for index, data in enumerate(raw):
        where = f"{param}[{index}]"
        if not isinstance(data, dict):
            raise _invalid(f"{where} must be an object, got {type(data).__name__}", where, "invalid_type")
        kind = data.get("type", "message")
        if kind in _DROPPED_ITEMS:
            logger.debug("dropping a %r input item (nothing in it applies to this model)", kind)
            continue
        model = _ITEM_MODELS.get(kind)
        if model is None:
            raise _invalid(f"input item type {kind!r} is not supported (supported: "
                           f"{', '.join(repr(k) for k in _ITEM_MODELS)})", f"{where}.type", "unsupported_item_type")
        item = _typed(model, data, where)
        if isinstance(item, MessageItem):
            _content_text(item.content, f"{where}.content")  # refuse non-text parts now, naming them
        elif isinstance(item, FunctionCallOutputItem) and not isinstance(item.output, str):
            _content_text(item.output, f"{where}.output")
        items.append(item)
    return items


def chat_messages(items: Sequence[InputItem], names: ToolNames | None = None) -> list[dict[str, Any]]:
    """Input (or output) items -> chat messages: function calls join the assistant message before them.

    ``[user, assistant text, function_call a, function_call b, output a, output b]`` becomes ``[user,
    assistant {content, tool_calls: [a, b]}, tool a, tool b]``, the shape chat templates expect. A reasoning
    item's text becomes the next assistant message's ``reasoning_content``; a namespaced call gets the flat
    name its tool has in the chat request (``names``).
    """
    messages: list[dict[str, Any]] = []
    thinking = ""
    for item in items:
        if isinstance(item, ReasoningItem):
            thinking = "\n".join(t for t in (thinking, item.text()) if t)
            continue
        if isinstance(item, CompactionItem):
            if item.summary is None:
                logger.debug("dropping a compaction item this server did not make (encrypted for another)")
                continue
            messages.append({"role": "user", "content": f"{COMPACTION_INTRO}\n\n{item.summary}"})
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _content_text(item.content, "input")})
        elif isinstance(item, FunctionCallItem):
            name = names.flat(item.namespace, item.name) if names is not None else item.name
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not thinking:
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = item.output if isinstance(item.output, str) else _content_text(item.output, "input")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        if thinking and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = thinking
        if messages[-1]["role"] != "system":
            thinking = ""
    return messages


def merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system (and developer) messages before the first other one, as one system message: many chat
    templates honour only a first system message (Codex CLI sends two developer messages on every turn)."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    if head < 2:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:head] if m["content"])
    return [{"role": "system", "content": text}, *messages[head:]]


# The message a kept summary is read back as (the summary follows it).
COMPACTION_INTRO = "Summary of the conversation so far:"
# What the model is asked when a conversation is compacted (POST /v1/responses/compact).
COMPACTION_REQUEST = ("Write a concise summary of the conversation above for a continuation of it: the user's goals, "
                      "the decisions made, the facts and results found, and what is left to do. Keep names, numbers, "
                      "file paths and code identifiers exactly. Write only the summary.")


def check_metadata(metadata: dict[str, str] | None, param: str = "metadata") -> None:
    """OpenAI's bounds on ``metadata`` (16 pairs, keys of 64 and values of 512 characters); a 400 naming it."""
    metadata = metadata or {}
    if len(metadata) > _METADATA_MAX_PAIRS:
        raise _invalid(f"{param} holds at most {_METADATA_MAX_PAIRS} pairs, got {len(metadata)}", param)
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS:
            raise _invalid(f"{param} keys are at most {_METADATA_KEY_CHARS} characters and values at most "
                           f"{_METADATA_VALUE_CHARS}, got key {key[:80]!r}", param)


# --- the request ------------------------------------------------------------------------------------


class TextConfig(OpenAIBaseModel):
    """`text`: the output format ({"type": "text"}, {"type": "json_object"} or a flat json_schema format)."""

    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_format(self) -> TextConfig:
        if self.format is None:
            return self
        kind = self.format.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise _invalid(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                           "text.format.type")
        if kind == "json_schema":
            if not isinstance(self.format.get("name"), str):
                raise _invalid("text.format.name is required for json_schema", "text.format.name",
                               "missing_required_parameter")
            if not isinstance(self.format.get("schema"), dict):
                raise _invalid("text.format.schema must be a JSON Schema object", "text.format.schema",
                               "invalid_type")
        return self

    def echo_format(self) -> dict[str, Any]:
        """`text.format` as a Response repeats it: a json_schema format with every field OpenResponses'
        JsonSchemaResponseFormat requires (`description` null and `strict` false when the request left them out)."""
        if self.format is None:
            return {"type": "text"}
        if self.format["type"] != "json_schema":
            return self.format
        return {"description": None, **self.format, "strict": bool(self.format.get("strict"))}

    def chat_response_format(self) -> dict[str, Any] | None:
        """The chat `response_format` for this format (json_schema's fields move under `json_schema`)."""
        if self.format is None or self.format.get("type") == "text":
            return None
        if self.format["type"] == "json_object":
            return {"type": "json_object"}
        schema = {k: self.format[k] for k in ("name", "schema", "strict", "description") if k in self.format}
        return {"type": "json_schema", "json_schema": schema}


class ResponsesRequest(IdleTTLField):
    """POST /v1/responses."""

    model: str | None = Field(None, description="The served model name (see GET /v1/models).")
    input: str | list[Any] = Field(description="A string (one user message) or a list of input items.")
    instructions: str | None = Field(None, description="A system message put first (not carried over by "
                                     "previous_response_id).")
    previous_response_id: str | None = Field(None, description="Continue a stored response's conversation.")
    max_output_tokens: int | None = Field(None, description="Most tokens to generate (>= 1).")
    temperature: float | None = Field(None, description="Sampling temperature in [0, 2]; 0 is greedy. Default 1.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1]. Default 1.")
    tools: list[Any] | None = Field(None, description="Function tools; built-in tool types are refused.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="'none', 'auto', 'required', "
                                                     "{'type': 'function', 'name'} or allowed_tools.")
    parallel_tool_calls: bool | None = Field(None, description="Allow several calls in one answer (default true).")
    text: TextConfig | None = Field(None, description="text.format: text, json_object or json_schema.")
    stream: bool = Field(False, description="Stream semantic events (`event: response.*`) as server-sent events.")
    store: bool = Field(True, description="Keep the response (GET /v1/responses/{id}, previous_response_id).")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs, echoed back.")
    reasoning: dict[str, Any] | None = Field(None, description="`effort` reaches chat templates that take "
                                             "`reasoning_effort` ('none' also sets enable_thinking false); "
                                             "`summary` is accepted (the thinking is returned as it is).")
    user: str | None = None
    background: bool = Field(False, description="Run in the background: the answer is `queued` at once, then "
                             "polled (GET), cancelled (POST .../cancel) or streamed and resumed (starting_after).")
    conversation: str | dict[str, Any] | None = Field(
        None, description="A conversation (its id, or {'id'}) whose items come before the input; the input and the "
        "output are added to it.")
    prompt: Any = Field(None, description="Not supported (no stored prompt templates).")
    _items: list[InputItem] = PrivateAttr(default_factory=list)
    _tools: list[FunctionTool] = PrivateAttr(default_factory=list)
    _names: ToolNames = PrivateAttr(default_factory=ToolNames)

    @model_validator(mode="after")
    def _check_request(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise _invalid("background mode needs store=true (its result is kept to be fetched)", "background",
                           "unsupported_parameter")
        if self.conversation is not None and self.previous_response_id is not None:
            raise _invalid("conversation and previous_response_id cannot be used together", "conversation",
                           "mutually_exclusive_parameters")
        if isinstance(self.conversation, dict) and not isinstance(self.conversation.get("id"), str):
            raise _invalid("conversation must be a conversation id or {'id': ...}", "conversation.id", "invalid_type")
        if self.prompt is not None:
            raise _invalid("stored prompt templates are not supported; send input and instructions",
                           "prompt", "unsupported_parameter")
        if self.input == "" or self.input == []:
            raise _invalid("input must not be empty", "input")
        ignored = sorted(k for k, v in (self.model_extra or {}).items() if k in IGNORED_FIELDS and v)
        if ignored:
            logger.info("responses: ignoring fields that do not apply to this server: %s", ignored)
        self._check_metadata()
        self._items = [] if isinstance(self.input, str) else parse_items(self.input)
        self._tools, self._names = function_tools(self.tools or [])
        return self

    @property
    def tool_names(self) -> ToolNames:
        """The chat names of the function tools and the (namespace, name) each stands for."""
        return self._names

    def _check_metadata(self) -> None:
        check_metadata(self.metadata)

    def input_items(self) -> list[InputItem]:
        """The input as items (a string input is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self._items)

    def to_chat_request(self, history: Sequence[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The chat request this Responses request stands for.

        Args:
            history: chat messages of the previous response's conversation (previous_response_id), put
                between the instructions and this request's input.

        Returns:
            A validated ChatCompletionRequest; InvalidRequestError naming the Responses field otherwise.
        """
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages.extend(history)
        messages.extend(chat_messages(self.input_items(), self._names))
        body: dict[str, Any] = {"messages": merge_leading_system(messages), "stream": self.stream}
        effort = (self.reasoning or {}).get("effort")
        if isinstance(effort, str):
            body["reasoning_effort"] = effort
            if effort == "none":  # templates that think unless told (Qwen3, SmolLM3) take this
                body["chat_template_kwargs"] = {"enable_thinking": False}
        for name in ("model", "temperature", "top_p", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        for name in SAMPLING_EXTRAS:
            if name in (self.model_extra or {}):
                body[name] = self.model_extra[name]  # type: ignore[index]
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        self._add_tools(body)
        if self.text is not None and (response_format := self.text.chat_response_format()) is not None:
            # NOTE(server): text.format shapes the message text; when tool_choice forces a call there is no
            # message text (the call's own grammar decides the output), so the format is left out. The
            # openai-agents SDK sends both on every turn of an agent with tools and an output_type.
            choice = body.get("tool_choice")
            if not (choice == "required" or isinstance(choice, dict)):
                body["response_format"] = response_format
        return chat_request_from(body, responses_param, "input")

    def _add_tools(self, body: dict[str, Any]) -> None:
        if not self._tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise _invalid("tool_choice needs tools", "tool_choice")
            return
        allowed = allowed_names(self.tool_choice)
        tools = [t for t in self._tools if allowed is None or t.name in allowed]
        body["tools"] = [t.to_chat() for t in tools]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, dict):
            return self.conversation["id"]
        return self.conversation

    def _extra(self, name: str, default: Any = None) -> Any:
        value = (self.model_extra or {}).get(name)
        return default if value is None else value

    def echo(self) -> dict[str, Any]:
        """The request fields a Response object repeats (every field OpenResponses' Response schema requires)."""
        text_format = self.text.echo_format() if self.text is not None else {"type": "text"}
        return {
            "background": self.background,
            "conversation": {"id": self.conversation_id} if self.conversation_id is not None else None,
            "frequency_penalty": float(self._extra("frequency_penalty", 0.0)),
            "max_tool_calls": self._extra("max_tool_calls"),
            "presence_penalty": float(self._extra("presence_penalty", 0.0)),
            "prompt_cache_key": self._extra("prompt_cache_key"),
            "prompt_cache_retention": self._extra("prompt_cache_retention"),
            "safety_identifier": self._extra("safety_identifier"),
            "service_tier": "default",
            "top_logprobs": int(self._extra("top_logprobs", 0)),
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": dict(self.metadata or {}),
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": (self.reasoning or {}).get("effort"),
                          "summary": (self.reasoning or {}).get("summary")},
            "store": self.store,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {"format": text_format},
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "tools": [t.echo() for t in self._tools],
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }


# --- response objects -------------------------------------------------------------------------------


def response_usage(num_prompt_tokens: int, num_generated_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """`usage` of a Response: input/output/total tokens; prompt tokens served from the prefix cache are
    `input_tokens_details.cached_tokens`."""
    return {
        "input_tokens": num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": num_generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt_tokens + num_generated_tokens,
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": parts}


def function_call_item(item_id: str, status: str, call_id: str, name: str, arguments: str,
                       namespace: str | None = None) -> dict[str, Any]:
    item = {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def reasoning_item(item_id: str, status: str, text: str) -> dict[str, Any]:
    """The model's thinking as it wrote it (``content`` reasoning_text; no summary, nothing encrypted)."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}


def response_object(skeleton: dict[str, Any], status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, error: dict[str, Any] | None = None,
                    incomplete_reason: str | None = None, completed_at: int | None = None,
                    metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Response object: `skeleton` (id, created_at, model and the request echo) plus the run's state (and
    `metrics` beside the usage: --per-request-spec-decode-metrics)."""
    return {
        **skeleton,
        "object": "response",
        "status": status,
        "completed_at": completed_at,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "output": output,
        "usage": usage,
        **({"metrics": metrics} if metrics is not None else {}),
    }


def response_skeleton(response_id: str, created_at: int, model: str, request: ResponsesRequest) -> dict[str, Any]:
    return {"id": response_id, "created_at": created_at, "model": model, **request.echo()}


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "reasoning": "rs", "compaction": "cmp",
                "compaction_summary": "cmp"}


def input_item_objects(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Input items as GET .../input_items lists them: each with an id, message content as parts."""
    objects = []
    for item in items:
        data = item.model_dump(exclude_none=True)
        if isinstance(item, MessageItem):
            part_type = "output_text" if item.role == "assistant" else "input_text"
            if isinstance(item.content, str):
                data["content"] = [{"type": part_type, "text": item.content}]
            data.setdefault("status", "completed")
        data.setdefault("id", new_id(_ID_PREFIXES.get(data["type"], "fco")))
        objects.append(data)
    return objects


def input_items_page(items: Sequence[dict[str, Any]], order: str, limit: int, after: str | None) -> dict[str, Any]:
    """One page of GET /v1/responses/{id}/input_items (`order` 'asc' or 'desc', `after` an item id)."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [item.get("id") for item in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
