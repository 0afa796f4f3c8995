"""The request fields chat and completions share, and their conversion to engine.types.SamplingParams (ranges are
checked once, there)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pydantic import Field, model_validator

from engine.types import InvalidRequestError, SamplingParams
from server.openai.base import IdleTTLField, OpenAIBaseModel, _unsupported
from server.openai.structured import StructuredOutputFields

BEAM_SEARCH_MESSAGE = (
    "beam search is not offered: the KV cache is one shared max-length buffer per layer and request, "
    "so candidate beams cannot fork it"
)


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
    speculative: bool | None = Field(None, description="false: no speculative drafts for this request (prompt "
                                     "lookup or --draft-model); the output is the same either way.")
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", description="Most draft tokens one check "
                                          "holds for this request, [0, 64] (llama.cpp's field; 0: no drafts).")
    draft_model: str | None = Field(None, description="LM Studio's field: accepted when it names the server's "
                                    "--draft-model (a 400 otherwise); drafts are on for the request.")
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
            draft_max_tokens=0 if self.speculative is False else self.speculative_n_max,
            draft_model=self.draft_model,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


SamplingFieldsT = TypeVar("SamplingFieldsT", bound=_SamplingFields)


def _resolve_max_tokens(requested: int | None, param: str, default_max_tokens: int, max_model_len: int) -> int:
    """Requested or default max_tokens, clamped to the context (the engine then ends with 'length')."""
    if requested is None:
        return max(1, min(default_max_tokens, max_model_len))
    if requested < 1:
        raise InvalidRequestError(f"{param} must be >= 1, got {requested}", param=param, code="invalid_value")
    return min(requested, max_model_len)


# --- the model's own sampling defaults ------------------------------------------------------------------

def with_defaults(body: SamplingFieldsT, model_defaults: Mapping[str, float | int],
                  default_temperature: float | None = None) -> SamplingFieldsT:
    """``body`` with the sampling fields it leaves unset filled in: its own values first, then the server's
    ``--default-temperature``, then the model's defaults (its generation_config.json's, engine.model_loader
    .generation_defaults), then the APIs' (temperature 1, no truncation, no penalty)."""
    unset = {name: value for name, value in model_defaults.items() if getattr(body, name) is None}
    if default_temperature is not None and body.temperature is None:
        unset["temperature"] = default_temperature
    return body.model_copy(update=unset) if unset else body
