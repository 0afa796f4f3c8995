"""OpenAI wire format: the chat and completion requests (validated at the edge) and the response/chunk builders.

With its siblings (server.openai.base, messages: the chat messages and tools, sampling_fields: what chat and
completions share and its conversion to engine.types.SamplingParams) the only place that spells OpenAI field names.
Must not import onnxruntime or any engine module other than engine.types.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from engine.types import FinishReason, InvalidRequestError, SamplingParams, TokenLogprob
from server.prompt import TemplateOptions
from server.openai.base import _unsupported
from server.openai.messages import ChatMessage, NamedToolChoice, ToolDefinition
from server.openai.sampling_fields import _resolve_max_tokens, _SamplingFields
from server.tools.plan import ToolRequest

# --- chat request -----------------------------------------------------------------------------------


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


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


def chat_usage_chunk(request_id: str, created: int, model: str, usage_dict: dict[str, int],
                     metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """The last chunk under stream_options.include_usage: no choices, only usage (and ``metrics``, if any)."""
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage_dict,
    }
    if metrics is not None:
        chunk["metrics"] = metrics
    return chunk


def chat_completion(
    request_id: str, created: int, model: str, text: str | None, finish_reason: str | None,
    usage_dict: dict[str, int], logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole `chat.completion`; ``tool_calls`` ([{id, type, function: {name, arguments}}]) when the
    answer made calls (``text`` is then None unless it also has text); ``reasoning``: the model's thinking, as
    `reasoning_content` and `reasoning` (clients read one or the other); ``metrics``: ``StreamContext.metrics``'."""
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
        **({"metrics": metrics} if metrics is not None else {}),
    }


def completion_chunk(
    request_id: str, created: int, model: str, text: str, finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None, usage_dict: dict[str, int] | None = None, with_choice: bool = True,
    with_usage_field: bool = False, index: int = 0, metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `text_completion` object: one streamed chunk, or the whole response when not streaming (``metrics``: with
    the usage, ``StreamContext.metrics``')."""
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
    if metrics is not None:
        body["metrics"] = metrics
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
