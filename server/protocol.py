"""OpenAI wire format: request models (validated at the edge) and response/chunk builders.

The only module that spells OpenAI field names; converts requests to engine.types.SamplingParams.
Must not import onnxruntime or any engine module other than engine.types.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.types import FinishReason, InvalidRequestError, SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)

BEAM_SEARCH_MESSAGE = (
    "beam search is not offered: the KV cache is one shared max-length buffer per layer and request, "
    "so candidate beams cannot fork it"
)


class OpenAIBaseModel(BaseModel):
    """Accepts unknown fields and logs them at debug level (clients send vendor extras freely)."""

    # NOTE(server): strict=True rejects "10" for an int and "true" for a bool, as OpenAI does;
    # ints are still accepted where floats are expected.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _log_extra_fields(self) -> OpenAIBaseModel:
        if self.model_extra:
            logger.debug("ignoring unknown fields of %s: %s", type(self).__name__, sorted(self.model_extra))
        return self


def _unsupported(param: str, message: str, code: str = "unsupported_parameter") -> InvalidRequestError:
    # NOTE(server): InvalidRequestError is a ValueError, so pydantic carries it (with .param/.code)
    # inside the ValidationError; server/errors.py unwraps it by class.
    return InvalidRequestError(message, param=param, code=code)


# --- chat request -----------------------------------------------------------------------------------


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="Who wrote the message ('developer' is treated as 'system')."
    )
    content: str | list[dict[str, Any]] | None = Field(
        None, description="A string or an array of {'type': 'text', 'text': ...} parts."
    )
    name: str | None = None

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
        if self.model_extra and self.model_extra.get("tool_calls"):
            raise _unsupported("tool_calls", "tool calls are not supported yet")
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


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` and empty `choices`.")


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by chat and completions; ranges are checked once, by SamplingParams."""

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
                                          param="logit_bias") from None
            if token_id < 0:
                raise InvalidRequestError(f"logit_bias keys must be >= 0, got {token_id}", param="logit_bias")
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
            n=self.n,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _resolve_max_tokens(requested: int | None, param: str, default_max_tokens: int, max_model_len: int) -> int:
    """Requested or default max_tokens, clamped to the context (the engine then ends with 'length')."""
    if requested is None:
        return max(1, min(default_max_tokens, max_model_len))
    if requested < 1:
        raise InvalidRequestError(f"{param} must be >= 1, got {requested}", param=param)
    return min(requested, max_model_len)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(description="The conversation so far; at least one message.")
    max_completion_tokens: int | None = Field(None, description="Alias of max_tokens (wins when both are set).")
    logprobs: bool = Field(False, description="Return the log-probability of each generated token.")
    top_logprobs: int | None = Field(None, description="Alternatives per token with logprobs=true, [0, 20].")
    response_format: dict[str, Any] | None = Field(None, description="Only {'type': 'text'} is supported.")
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported yet.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Not supported yet ('none' is accepted).")
    functions: list[dict[str, Any]] | None = Field(None, description="Not supported.")

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if not self.messages:
            raise InvalidRequestError("messages must contain at least one message", param="messages",
                                      code="invalid_value")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise _unsupported("response_format", "response_format is not supported yet (only {'type': 'text'})")
        if self.tools:
            raise _unsupported("tools", "tools are not supported yet")
        if self.functions:
            raise _unsupported("functions", "functions are not supported")
        if self.tool_choice not in (None, "none"):
            raise _unsupported("tool_choice", "tool_choice is not supported yet (tools are not supported)")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs",
                                      code="invalid_value")
        return self

    def template_messages(self) -> list[dict[str, str]]:
        """Messages for the chat template: plain role/content strings ('developer' becomes 'system')."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages
        ]

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
    request_id: str, created: int, model: str, text: str, finish_reason: str | None,
    usage_dict: dict[str, int], logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
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


def model_card(model_id: str, created: int, owned_by: str = "ortserve", max_model_len: int | None = None) -> dict:
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """The one error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
