"""OpenAI wire format: request models (validated at the edge) and response/chunk builders.

The only module that spells OpenAI field names; converts requests to engine.types.SamplingParams.
Must not import onnxruntime or any engine module other than engine.types.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.types import FinishReason, InvalidRequestError, SamplingParams, TokenLogprob
from server.prompt import TemplateOptions
from server.openai.structured import StructuredOutputFields
from server.tools.plan import ToolRequest

logger = logging.getLogger(__name__)

BEAM_SEARCH_MESSAGE = (
    "beam search is not offered: the KV cache is one shared max-length buffer per layer and request, "
    "so candidate beams cannot fork it"
)


def _nullable_when_optional(schema: dict[str, Any]) -> None:
    """JSON schema of a request model: every optional field also accepts null (see _null_means_absent)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or any(v.get("type") == "null" for v in prop.get("anyOf", [prop])):
            continue
        meta = {key: prop.pop(key) for key in ("title", "description", "default") if key in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **meta}


class OpenAIBaseModel(BaseModel):
    """Accepts unknown fields and logs them at debug level (clients send vendor extras freely); null in an
    optional field means the field is absent."""

    # NOTE(server): strict=True rejects "10" for an int and "true" for a bool, as OpenAI does;
    # ints are still accepted where floats are expected.
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_nullable_when_optional)

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        # NOTE(server): OpenAI's schema marks most optional request fields nullable (n, stream, stop, temperature,
        # logprobs, stream_options, ...) and clients send null for "not set"; as vLLM and llama.cpp do, null
        # takes the default. A required field (messages, prompt, role) stays required.
        if not isinstance(data, dict):
            return data
        optional = {key for name, field in cls.model_fields.items() if not field.is_required()
                    for key in (name, field.alias) if key}
        return {key: value for key, value in data.items() if value is not None or key not in optional}

    @model_validator(mode="after")
    def _log_extra_fields(self) -> OpenAIBaseModel:
        if self.model_extra:
            logger.debug("ignoring unknown fields of %s: %s", type(self).__name__, sorted(self.model_extra))
        return self


def _unsupported(param: str, message: str, code: str = "unsupported_parameter") -> InvalidRequestError:
    # NOTE(server): InvalidRequestError is a ValueError, so pydantic carries it (with .param/.code)
    # inside the ValidationError; server/errors.py unwraps it by class.
    return InvalidRequestError(message, param=param, code=code)


class IdleTTLField(OpenAIBaseModel):
    """LM Studio's per-request ``ttl``, beside the OpenAI fields of chat, completions, responses and embeddings."""

    ttl: float | None = Field(None, description="LM Studio's idle TTL: seconds the model stays loaded once idle "
                                                "(its idle unload, as Ollama's keep_alive; 0: right after this "
                                                "request). A pinned model never unloads.")

    @field_validator("ttl")
    @classmethod
    def _check_ttl(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value < float("inf"):
            # NOTE(server): no param here: the error names the field's location (ttl)
            raise InvalidRequestError(f"ttl must be a number of seconds >= 0, got {value}", code="invalid_value")
        return value


# --- chat request -----------------------------------------------------------------------------------


class FunctionCall(OpenAIBaseModel):
    name: str = Field(description="The function called.")
    arguments: str | dict[str, Any] = Field(description="The arguments, as JSON text.")


class AssistantToolCall(OpenAIBaseModel):
    """A call in an assistant message of the history."""

    id: str = Field(description="The call's id; the tool message that answers it repeats it.")
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        description="Who wrote the message ('developer' is treated as 'system'; 'tool' answers a tool call)."
    )
    content: str | list[dict[str, Any]] | None = Field(
        None, description="A string or an array of {'type': 'text', 'text': ...} parts."
    )
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, description="Calls an assistant message made.")
    tool_call_id: str | None = Field(None, description="In a tool message: the id of the call it answers.")
    reasoning_content: str | None = Field(None, description="In an assistant message: its thinking (templates "
                                          "that render past thinking show it).")
    reasoning: str | None = Field(None, description="The same as reasoning_content (vLLM's and Ollama's name).")

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(value, list):
            for index, part in enumerate(value):
                kind = part.get("type")
                if kind != "text":
                    raise InvalidRequestError(
                        f"only 'text' content parts are supported, got type {kind!r} in part {index}",
                        code="unsupported_content_type",
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content[{index}].text must be a string")
        return value

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.role == "function":
            raise _unsupported("role", "'function' messages (the deprecated functions API) are not supported; "
                                       "use tools and 'tool' messages")
        if self.tool_calls and self.role != "assistant":
            raise _unsupported("tool_calls", f"only assistant messages carry tool_calls, not {self.role}",
                               code="invalid_value")
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequestError("a tool message needs the tool_call_id of the call it answers",
                                      param="tool_call_id", code="missing_required_parameter")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined without separator, as OpenAI does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# Deeper parameter schemas are refused before anything walks them recursively (the schema check, the grammar).
MAX_SCHEMA_DEPTH = 64


def _nesting_depth(value: Any) -> int:
    """How deep JSON containers nest in ``value`` (iterative: a hostile depth cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(description="a-z, A-Z, 0-9, '_' and '-', at most 64 characters.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments (none: no arguments).")
    strict: bool | None = Field(None, description="Accepted; calls always follow the schema when forced.")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _FUNCTION_NAME.match(value):
            raise InvalidRequestError(f"function names are 1-64 characters of a-z, A-Z, 0-9, '_' and '-', "
                                      f"got {value!r}", code="invalid_value")
        return value

    @field_validator("parameters")
    @classmethod
    def _check_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        depth = _nesting_depth(value)
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"parameters nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are "
                                      "supported", code="invalid_value")
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except RecursionError:
            raise InvalidRequestError("parameters nests too deeply to be checked", code="invalid_value") from None
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.path)
            raise InvalidRequestError(f"parameters is not a valid JSON Schema: {exc.message}"
                                      + (f" (at {where})" if where else ""), code="invalid_value") from None
        if value.get("type", "object") != "object":
            raise InvalidRequestError(f"parameters must describe an object (the arguments), got type "
                                      f"{value.get('type')!r}", code="invalid_value")
        return value


class ToolDefinition(OpenAIBaseModel):
    type: Literal["function"] = Field(description="Only function tools exist.")
    function: FunctionDefinition


class NamedToolChoice(OpenAIBaseModel):
    class Function(OpenAIBaseModel):
        name: str

    type: Literal["function"]
    function: Function


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` and empty `choices`.")


class _SamplingFields(IdleTTLField, StructuredOutputFields):
    """Fields shared by chat and completions (structured outputs: StructuredOutputFields); ranges are checked
    once, by SamplingParams."""

    model: str | None = Field(None, description="The served model name (see GET /v1/models).")
    max_tokens: int | None = Field(None, description="Most tokens to generate (>= 1).")
    temperature: float | None = Field(None, description="Sampling temperature in [0, 2]; 0 is greedy. Default 1.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1]. Default 1.")
    top_k: int | None = Field(None, description="Keep the k most likely tokens; 0 disables.")
    min_p: float | None = Field(None, description="Drop tokens below min_p times the top probability, [0, 1].")
    seed: int | None = Field(None, description="Seed for reproducible sampling.")
    stop: str | list[str] | None = Field(None, description="Stop string(s); never part of the output.")
    stop_token_ids: list[int] | None = Field(None, description="Extra token ids that end generation.")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence (benchmarks).")
    n: int = Field(1, description="Number of choices (>= 1, at most the server's --max-batch); the prompt runs once.")
    presence_penalty: float | None = Field(None, description="[-2, 2]; penalizes tokens already present.")
    frequency_penalty: float | None = Field(None, description="[-2, 2]; penalizes tokens by their count.")
    repetition_penalty: float | None = Field(None, description="[0.01, 2]; 1 disables (multiplicative, as HF).")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) to bias in [-100, 100].")
    stream: bool = Field(False, description="Stream chunks as server-sent events.")
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: int | None = Field(None, description="Not supported above 1 (no beam search).")
    use_beam_search: bool = Field(False, description="Not supported (no beam search).")

    @model_validator(mode="after")
    def _check_supported(self) -> _SamplingFields:
        if self.best_of is not None and self.best_of < 1:
            raise InvalidRequestError(f"best_of must be >= 1, got {self.best_of}", param="best_of",
                                      code="invalid_value")
        if self.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {self.n}", param="n", code="invalid_value")
        if self.use_beam_search or (self.best_of is not None and self.best_of != 1):
            raise _unsupported("best_of" if not self.use_beam_search else "use_beam_search", BEAM_SEARCH_MESSAGE)
        if self.stream_options is not None and not self.stream:
            raise _unsupported("stream_options", "stream_options is only allowed with stream=true",
                               code="invalid_value")
        return self

    def _stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                          param="logit_bias", code="invalid_value") from None
            if token_id < 0:
                raise InvalidRequestError(f"logit_bias keys must be >= 0, got {token_id}", param="logit_bias",
                                          code="invalid_value")
            pairs.append((token_id, float(bias)))
        return tuple(pairs)

    def _sampling(self, max_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else float(self.min_p),
            # NOTE(server): OpenAI seeds are any int64; numpy wants >= 0, so map them onto [0, 2**64).
            seed=None if self.seed is None else self.seed % 2**64,
            stop=self._stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=0.0 if self.presence_penalty is None else float(self.presence_penalty),
            frequency_penalty=0.0 if self.frequency_penalty is None else float(self.frequency_penalty),
            repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            logit_bias=self._logit_bias(),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            structured=self.structured_output(),
            n=self.n,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _resolve_max_tokens(requested: int | None, param: str, default_max_tokens: int, max_model_len: int) -> int:
    """Requested or default max_tokens, clamped to the context (the engine then ends with 'length')."""
    if requested is None:
        return max(1, min(default_max_tokens, max_model_len))
    if requested < 1:
        raise InvalidRequestError(f"{param} must be >= 1, got {requested}", param=param, code="invalid_value")
    return min(requested, max_model_len)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(description="The conversation so far; at least one message.")
    max_completion_tokens: int | None = Field(None, description="Alias of max_tokens (wins when both are set).")
    logprobs: bool = Field(False, description="Return the log-probability of each generated token.")
    top_logprobs: int | None = Field(None, description="Alternatives per token with logprobs=true, [0, 20].")
    tools: list[ToolDefinition] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'auto' (the default with tools), 'none', 'required', or {'type': 'function', "
                          "'function': {'name': ...}} to force that function.")
    parallel_tool_calls: bool | None = Field(None, description="Allow several calls in one answer (default: true where "
                                             "the model has a native tool format, one call in the generic format).")
    functions: list[dict[str, Any]] | None = Field(None, description="Deprecated; not supported (use tools).")
    function_call: str | dict[str, Any] | None = Field(None, description="Deprecated; not supported (use "
                                                                         "tool_choice).")
    reasoning_effort: str | None = Field(None, description="Passed to chat templates that take it "
                                         "(`reasoning_effort`); ignored by the others.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="More chat template variables, e.g. "
                                                        "{'enable_thinking': false}.")
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant turn's opening.")
    continue_final_message: bool = Field(False, description="The answer continues the last (assistant) message; "
                                         "needs add_generation_prompt=false.")
    echo: bool = Field(False, description="The answer starts with the last message when it is the assistant's.")

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if not self.messages:
            raise InvalidRequestError("messages must contain at least one message", param="messages",
                                      code="invalid_value")
        if self.functions:
            raise _unsupported("functions", "functions (deprecated) is not supported; use tools")
        if self.function_call is not None:
            raise _unsupported("function_call", "function_call (deprecated) is not supported; use tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs",
                                      code="invalid_value")
        self.template_options()  # refuses continue_final_message with add_generation_prompt, reserved kwargs
        return self

    def template_options(self) -> TemplateOptions:
        """The chat template controls (reasoning_effort reaches templates that take it)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return TemplateOptions(self.add_generation_prompt, self.continue_final_message, self.echo, kwargs)

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidRequestError(f"tools has two functions named {dup!r}", param="tools", code="invalid_value")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice names the function {choice.function.name!r}, which is not in "
                                      f"tools ({names})", param="tool_choice", code="invalid_value")
        if choice == "required" and not names:
            raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice",
                                      code="invalid_value")
        structured = self.structured_output()
        if (structured is not None and structured.kind not in ("json_schema", "json_object")
                and self.tool_request().calls_possible):
            raise _unsupported(structured.param, f"{structured.param} cannot be combined with tools that may be "
                               "called (tool calls are constrained by their own grammar); send tool_choice 'none' "
                               "or leave out one of them (a JSON schema or json_object response_format can)")
        return self

    def check_tool_answers(self) -> None:
        """Every ``tool`` message answers a call an earlier assistant message made (by its ``tool_call_id``),
        as OpenAI requires; raises InvalidRequestError (400) naming the first one that answers nothing."""
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.role == "assistant" and m.tool_calls:
                called.update(c.id for c in m.tool_calls)
            elif m.role == "tool" and m.tool_call_id not in called:
                raise InvalidRequestError(
                    f"messages[{i}] is a 'tool' message whose tool_call_id {m.tool_call_id!r} answers no "
                    f"tool call of an earlier assistant message (calls so far: {sorted(called) or 'none'})",
                    param=f"messages[{i}].tool_call_id", code="invalid_value")

    def tool_request(self) -> ToolRequest:
        """The tool fields as the tool planner takes them (choice 'auto' when tools are given, as OpenAI); a JSON
        output constraint becomes the schema of an answer that makes no call."""
        tools = tuple(t.model_dump(exclude_none=True) for t in self.tools or ())
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        structured = self.structured_output() if tools else None
        response: dict[str, Any] | None = None
        if structured is not None and structured.kind == "json_schema":
            response = json.loads(structured.spec)
        elif structured is not None and structured.kind == "json_object":
            response = {"type": "object"}
        if isinstance(choice, NamedToolChoice):
            return ToolRequest(tools, "function", choice.function.name, self.parallel_tool_calls, response)
        return ToolRequest(tools, choice, None, self.parallel_tool_calls, response)

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages for the chat template: role/content strings ('developer' becomes 'system'), plus
        ``tool_calls`` (arguments as JSON text) on assistant messages and ``tool_call_id`` on tool results."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": _arguments_text(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.role == "tool":
                message["tool_call_id"] = m.tool_call_id
                if m.name:
                    message["name"] = m.name
            thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if m.role == "assistant" and thinking:
                message["reasoning_content"] = thinking  # the name templates read (Qwen3, DeepSeek-R1)
            out.append(message)
        return out

    def to_sampling_params(self, default_max_tokens: int, max_model_len: int) -> SamplingParams:
        """The engine's SamplingParams for this request.

        Args:
            default_max_tokens: used when neither max_tokens nor max_completion_tokens is given
                (tokens; normally the context left after the prompt).
            max_model_len: the context length in tokens; larger max_tokens are clamped to it.

        Returns:
            Validated SamplingParams; raises InvalidRequestError naming the parameter otherwise.
        """
        if self.max_completion_tokens is not None:
            requested, param = self.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = self.max_tokens, "max_tokens"
        max_tokens = _resolve_max_tokens(requested, param, default_max_tokens, max_model_len)
        top_logprobs = self.top_logprobs or 0
        return self._sampling(max_tokens, logprobs=self.logprobs, top_logprobs=top_logprobs)


# --- completions request ----------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    """POST /v1/completions (one prompt: a string or a list of token ids)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="One prompt (text or token ids).")
    logprobs: int | None = Field(None, description="Return this many alternatives per token, [0, 20].")
    echo: bool = Field(False, description="Not supported.")
    suffix: str | None = Field(None, description="Not supported.")

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.echo:
            raise _unsupported("echo", "echo is not supported")
        if self.suffix:
            raise _unsupported("suffix", "suffix is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            # NOTE(server): checked here, as `logprobs` (the completions name); SamplingParams would name it
            # top_logprobs.
            raise InvalidRequestError(f"logprobs must be in [0, 20], got {self.logprobs}", param="logprobs",
                                      code="invalid_value")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise _unsupported("prompt", f"one prompt per request is supported, got {len(self.prompt)}")
        if self.prompt == "" or self.prompt == [] or self.prompt == [[]] or self.prompt == [""]:
            raise InvalidRequestError("prompt must not be empty", param="prompt", code="invalid_value")
        return self

    def prompt_text_or_ids(self) -> str | list[int]:
        """The single prompt: a string to tokenize, or token ids as given."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return prompt  # type: ignore[return-value]

    def to_sampling_params(self, default_max_tokens: int, max_model_len: int) -> SamplingParams:
        """As ChatCompletionRequest.to_sampling_params (OpenAI's completions default is 16 tokens)."""
        max_tokens = _resolve_max_tokens(self.max_tokens, "max_tokens", default_max_tokens, max_model_len)
        if self.logprobs is None:
            return self._sampling(max_tokens, logprobs=False, top_logprobs=0)
        return self._sampling(max_tokens, logprobs=True, top_logprobs=self.logprobs)


# --- responses --------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(num_prompt_tokens: int, num_generated_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """`usage`; prompt tokens served from the prefix cache are `prompt_tokens_details.cached_tokens`."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_generated_tokens,
        "total_tokens": num_prompt_tokens + num_generated_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def finish_reason_str(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


TokenText = Callable[[int], str]


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """`choices[].logprobs` of chat: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, text_offset: int) -> dict[str, Any]:
    """`choices[].logprobs` of completions: parallel lists tokens/token_logprobs/top_logprobs/text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text = token_text(e.token_id)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        tops.append({token_text(t): lp for t, lp in e.top} if e.top else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    with_usage_field: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    """One `chat.completion.chunk` with a single choice (``index``: which of n)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def chat_usage_chunk(request_id: str, created: int, model: str, usage_dict: dict[str, int]) -> dict[str, Any]:
    """The last chunk under stream_options.include_usage: no choices, only usage."""
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage_dict,
    }


def chat_completion(
    request_id: str, created: int, model: str, text: str | None, finish_reason: str | None,
    usage_dict: dict[str, int], logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None,
) -> dict[str, Any]:
    """The whole `chat.completion`; ``tool_calls`` ([{id, type, function: {name, arguments}}]) when the
    answer made calls (``text`` is then None unless it also has text); ``reasoning``: the model's thinking, as
    `reasoning_content` and `reasoning` (clients read one or the other)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }],
        "usage": usage_dict,
    }


def completion_chunk(
    request_id: str, created: int, model: str, text: str, finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None, usage_dict: dict[str, int] | None = None, with_choice: bool = True,
    with_usage_field: bool = False, index: int = 0,
) -> dict[str, Any]:
    """A `text_completion` object: one streamed chunk, or the whole response when not streaming."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": (
            [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}] if with_choice
            else []
        ),
    }
    if usage_dict is not None or with_usage_field:
        body["usage"] = usage_dict
    return body


def with_choices(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One response of n choices (n > 1) from one single-choice response per choice, in choice order."""
    body = dict(bodies[0])
    body["choices"] = [{**b["choices"][0], "index": index} for index, b in enumerate(bodies)]
    return body


def model_card(model_id: str, created: int, owned_by: str = "ortserve", max_model_len: int | None = None,
               dimensions: int | None = None) -> dict:
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    if dimensions is not None:  # an embedding model: the length of its vectors
        card["dimensions"] = dimensions
    return card


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """The one error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# --- other protocols on the chat path ---------------------------------------------------------------------


ParamRename = Callable[[str | None], str | None]


def param_renamer(names: dict[str, str]) -> ParamRename:
    """A function from a chat parameter to the field another protocol calls it (``names`` maps the first
    component: {"messages": "input"} turns 'messages[2].content' into 'input'); other names stay."""

    def rename(param: str | None) -> str | None:
        if param is None:
            return None
        return names.get(param.split("[", 1)[0].split(".", 1)[0], param)

    return rename


@contextmanager
def renamed_errors(rename: ParamRename) -> Iterator[None]:
    """Rename the `param` of InvalidRequestErrors the chat path raises inside the block."""
    try:
        yield
    except InvalidRequestError as exc:
        exc.param = rename(exc.param)
        raise


def chat_request_from(body: dict[str, Any], rename: ParamRename, default_param: str) -> ChatCompletionRequest:
    """Validate ``body`` (built by another protocol's request) as a ChatCompletionRequest; the first problem
    becomes an InvalidRequestError naming that protocol's field (``rename``; ``default_param`` when none)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequestError):
            cause.param = rename(cause.param)
            raise cause from None
        where = rename(".".join(str(p) for p in first.get("loc", ()) if isinstance(p, str)) or None)
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise InvalidRequestError(f"{where}: {message}" if where else message, param=where or default_param,
                                  code="invalid_value") from None
