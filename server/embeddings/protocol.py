"""The embeddings wire format: POST /v1/embeddings (OpenAI's, with vLLM's truncate_prompt_tokens) and
llama.cpp's /embedding(s), and their response bodies.

Must not import onnxruntime or any engine module other than engine.types.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from engine.types import InvalidRequestError
from server.openai.base import IdleTTLField, OpenAIBaseModel

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


@dataclass(frozen=True)
class EmbeddingInput:
    """One input: a text to tokenize, or the model's own token ids; ``param`` names it in errors."""

    param: str
    text: str | None = None
    token_ids: tuple[int, ...] | None = None


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _text_of(value: Any, param: str) -> str:
    """llama.cpp's object entries: {"content": [{"type": "text", "text": ...}, ...]} or {"prompt_string": ...}."""
    if isinstance(value.get("prompt_string"), str):
        return value["prompt_string"]
    parts = value.get("content")
    if isinstance(parts, list) and parts and all(isinstance(p, dict) for p in parts):
        for j, part in enumerate(parts):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"{param}.content[{j}] must be a text part ({{'type': 'text', 'text': ...}}); this model embeds "
                    f"text only, got type {part.get('type')!r}", param=f"{param}.content[{j}]", code="invalid_value")
        return "".join(part["text"] for part in parts)
    raise InvalidRequestError(f"{param} must be a string, a list of token ids, or an object with 'prompt_string' or "
                              f"a 'content' list of text parts", param=param, code="invalid_type")


def parse_inputs(value: Any, field: str = "input") -> list[EmbeddingInput]:
    """OpenAI's ``input`` (a string, a list of strings, a list of token ids, a list of lists of token ids) plus
    llama.cpp's object entries, as a list of inputs in order.

    Raises:
        InvalidRequestError naming the field or the item: an empty list, an item of another type (a number
        among strings, null, a float), an empty token list, or more than MAX_INPUTS inputs.
    """
    if isinstance(value, str):
        return [EmbeddingInput(field, text=value)]
    if isinstance(value, dict):
        return [EmbeddingInput(field, text=_text_of(value, field))]
    if not isinstance(value, list):
        raise InvalidRequestError(f"{field} must be a string or a list of strings or token ids, got "
                                  f"{type(value).__name__}", param=field, code="invalid_type")
    if not value:
        raise InvalidRequestError(f"{field} must not be an empty list", param=field, code="invalid_value")
    if _is_token_list(value):
        return [EmbeddingInput(field, token_ids=tuple(value))]
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError(f"{field} has {len(value)} items; at most {MAX_INPUTS} per request",
                                  param=field, code="invalid_value")
    out = []
    for i, item in enumerate(value):
        param = f"{field}[{i}]"
        if isinstance(item, str):
            out.append(EmbeddingInput(param, text=item))
        elif _is_token_list(item):
            out.append(EmbeddingInput(param, token_ids=tuple(item)))
        elif isinstance(item, dict):
            out.append(EmbeddingInput(param, text=_text_of(item, param)))
        elif isinstance(item, list) and not item:
            raise InvalidRequestError(f"{param} is an empty list of token ids", param=param, code="invalid_value")
        else:
            what = "a list holding non-integers" if isinstance(item, list) else type(item).__name__
            raise InvalidRequestError(f"{param} must be a string or a list of token ids (every item of {field} "
                                      f"the same kind), got {what}", param=param, code="invalid_type")
    return out


class EmbeddingRequest(IdleTTLField):
    """POST /v1/embeddings."""

    model: str | None = Field(None, description="The embedding model (default: the server's --embedding-model, "
                                                "else the chat model when it serves --embeddings).")
    input: Any = Field(description="A string, a list of strings, a list of token ids, or a list of lists of "
                                   "token ids (the model's own ids).")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="'float' (a list of numbers) or 'base64' (little-endian float32 bytes).")
    dimensions: int | None = Field(None, description="Output dimensions: the model's own, or one it was trained "
                                                     "to be truncated to (Matryoshka).")
    user: str | None = Field(None, description="An end-user id (accepted, not used).")
    truncate_prompt_tokens: int | None = Field(
        None, description="Truncate each input to this many tokens (its end is cut; -1: the model's window). "
                          "Without it an input longer than the window is a 400.")

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be >= 1, got {self.dimensions}", param="dimensions",
                                      code="invalid_value")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (the window) or >= 1, got "
                                      f"{self.truncate_prompt_tokens}", param="truncate_prompt_tokens",
                                      code="invalid_value")
        return self

    def inputs(self) -> list[EmbeddingInput]:
        return parse_inputs(self.input)

    def truncate_to(self, window: int) -> int | None:
        """The token count inputs are cut to, or None (no truncation: a longer input is a 400)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k == -1:
            return window
        if not 1 <= k <= window:
            raise InvalidRequestError(f"truncate_prompt_tokens must be in [1, {window}] (the model's window) or -1, "
                                      f"got {k}", param="truncate_prompt_tokens", code="invalid_value")
        return k


class LlamaCppEmbeddingRequest(OpenAIBaseModel):
    """llama.cpp's POST /embedding (and /embeddings): ``content`` (or ``input``), answered per input."""

    content: Any = Field(None, description="A string, a list of strings or token ids (as /v1/embeddings' input).")
    input: Any = Field(None, description="Same as content.")
    model: str | None = Field(None, description="The embedding model (default as for /v1/embeddings).")

    def inputs(self) -> list[EmbeddingInput]:
        if self.input is not None:
            return parse_inputs(self.input, "input")
        if self.content is not None:
            return parse_inputs(self.content, "content")
        raise InvalidRequestError("'content' is a required property", param="content",
                                  code="missing_required_parameter")


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """float32 values as a JSON list, or base64 of their little-endian bytes (what the openai SDK decodes)."""
    v = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(v.tobytes()).decode("ascii")
    return v.tolist()


def embedding_response(vectors: Sequence[np.ndarray], model: str, num_prompt_tokens: int,
                       encoding_format: str = "float") -> dict[str, Any]:
    """The OpenAI body: {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
    "usage"}; ``data[i].index`` is input i."""
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
                 for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }


def llamacpp_embedding_response(vectors: Sequence[np.ndarray]) -> list[dict[str, Any]]:
    """llama.cpp's /embedding body: [{"index": i, "embedding": [[...], ...]}], one vector per token with
    pooling 'none', else a list holding the pooled vector."""
    return [{"index": i, "embedding": np.asarray(v, np.float32).reshape(-1, v.shape[-1]).tolist()}
            for i, v in enumerate(vectors)]
