"""What the server needs from an engine (typing only), so server/ never imports onnxruntime.

engine.async_engine.AsyncEngine satisfies it; nothing here runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from engine.types import EngineStats, RequestOutput, SamplingParams


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def min_num_tokens(self, text: str) -> int: ...

    def special_token_id(self, token: str) -> int | None: ...


class ChatTemplateLike(Protocol):
    supports_tools: bool
    tool_source: str

    source: str | None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               **extra: Any) -> str: ...


class EmbedderClient(Protocol):
    """An embedding engine as seen from the HTTP layer (engine.embedding.EmbeddingEngine satisfies it)."""

    model_name: str
    kind: str  # "encoder" or "decoder"
    dimension: int
    max_seq_length: int
    pooling: str
    normalize: bool

    def tokenize(self, texts: Sequence[str], truncate_to: int | None = None) -> list[list[int]]: ...

    def check(self, token_ids: Sequence[Sequence[int]], *, truncate_to: int | None = None,
              params: Sequence[str] | None = None) -> list[list[int]]: ...

    async def embed(self, token_ids: Sequence[Sequence[int]]) -> list[Any]: ...

    def stats(self) -> Any: ...

    def shutdown(self) -> Any: ...


class EngineClient(Protocol):
    """The engine as seen from the HTTP layer.

    `generate` yields RequestOutput deltas (whole UTF-8 characters, stop strings held back) and
    exactly one output with `finished=True`; raising EngineOverloadedError when the queue is full.
    """

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: TokenizerLike
    chat_template: ChatTemplateLike
    eog_token_ids: frozenset[int]  # every id that ends generation (engine.end_of_generation)
    sampling_defaults: dict[str, float | int]  # what the folder's generation_config.json recommends

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None: ...

    def shutdown(self) -> Any: ...
