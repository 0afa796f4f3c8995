"""The rerank and score wire formats: Jina's and Cohere's POST /v1/rerank (/rerank, /v2/rerank), Hugging Face TEI's
/rerank form (``texts``), and vLLM's POST /v1/score (``text_1``, ``text_2``). Validation errors name the field (400).
Must not import onnxruntime or any engine module but engine.types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from engine.types import InvalidRequestError
from server.openai.base import OpenAIBaseModel
from server.openai.protocol import new_id, now_s

MAX_DOCUMENTS = 1000  # Cohere's bound on documents per request


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def _texts(value: Any, param: str) -> list[str]:
    """A non-empty list of strings or ``{"text": ...}`` objects."""
    if not isinstance(value, list):
        raise _bad(f"{param} must be a list of strings or {{'text': ...}} objects, got "
                   f"{'null' if value is None else type(value).__name__}", param, "invalid_type")
    if not value:
        raise _bad(f"{param} must not be empty", param)
    if len(value) > MAX_DOCUMENTS:
        raise _bad(f"{param} holds {len(value)} documents; at most {MAX_DOCUMENTS}", param)
    out = []
    for i, item in enumerate(value):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise _bad(f"{param}[{i}] must be a string or an object with a string 'text', got "
                       f"{type(item).__name__}", f"{param}[{i}]", "invalid_type")
        out.append(text)
    return out


class RerankRequest(OpenAIBaseModel):
    """POST /v1/rerank, /rerank, /v2/rerank: Jina's and Cohere's ``documents``, or TEI's ``texts``."""

    model: str | None = Field(None, description="An embedding model or the chat model (default: --rerank-model).")
    query: Any = Field(description="The query the documents are ranked for.")
    documents: Any = Field(None, description="Strings or {'text': ...} objects (Jina, Cohere).")
    texts: Any = Field(None, description="Strings (Hugging Face TEI's form; the answer is then TEI's list).")
    top_n: int | None = Field(None, description="Return the best top_n documents (default: all).")
    return_documents: bool | None = Field(None, description="Include each document's text in its result.")
    return_text: bool | None = Field(None, description="TEI's name for return_documents.")
    _docs: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> RerankRequest:
        if not isinstance(self.query, str) or not self.query:
            raise _bad("query must be a non-empty string", "query", "invalid_type" if not isinstance(self.query, str)
                       else "invalid_value")
        if self.texts is not None and self.documents is None:
            self._docs = _texts(self.texts, "texts")
        else:
            self._docs = _texts(self.documents, "documents")
        if self.top_n is not None and self.top_n < 1:
            raise _bad(f"top_n must be >= 1, got {self.top_n}", "top_n")
        return self

    @property
    def tei(self) -> bool:
        return self.texts is not None and self.documents is None

    def document_texts(self) -> list[str]:
        return self._docs


def rerank_response(docs: Sequence[str], scores: Sequence[float], model: str, num_tokens: int, top_n: int | None,
                    return_documents: bool) -> dict[str, Any]:
    """Jina's and Cohere's body: results by relevance_score, best first, each with the document's ``index``."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": docs[i]}
        results.append(result)
    return {"id": new_id("rerank"), "model": model, "results": results,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def tei_response(docs: Sequence[str], scores: Sequence[float], top_n: int | None, return_text: bool) -> list[dict]:
    """TEI's body: a list of {index, score[, text]}, best first."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    return [{"index": i, "score": scores[i], **({"text": docs[i]} if return_text else {})} for i in order]


class ScoreRequest(OpenAIBaseModel):
    """POST /v1/score (vLLM's): ``text_1`` against ``text_2``: one to one, one to many, or many to many (pairwise)."""

    model: str | None = Field(None, description="An embedding model or the chat model (default: --rerank-model).")
    text_1: Any = Field(description="A string, or a list of strings (one per pair).")
    text_2: Any = Field(description="A string, or a list of strings.")
    _pairs: list[tuple[str, str]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> ScoreRequest:
        first = [self.text_1] if isinstance(self.text_1, str) else _texts(self.text_1, "text_1")
        second = [self.text_2] if isinstance(self.text_2, str) else _texts(self.text_2, "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise _bad(f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as "
                       f"text_2 (pairwise)", "text_2")
        self._pairs = list(zip(first, second))
        return self

    def pairs(self) -> list[tuple[str, str]]:
        return self._pairs


def score_response(scores: Sequence[float], model: str, num_tokens: int) -> dict[str, Any]:
    return {"id": new_id("score"), "object": "list", "created": now_s(), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
