"""The Batch API's wire shapes: the create request, the Batch object, the input lines and the output/error lines.

Pure: no I/O, no engine import.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import Field, model_validator

from engine.types import InvalidRequestError
from server.openai.base import OpenAIBaseModel
from server.responses.protocol import check_metadata

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOW_S = 24 * 3600
RUNNING = ("validating", "in_progress", "finalizing", "cancelling")


class CreateBatch(OpenAIBaseModel):
    """POST /v1/batches."""

    input_file_id: str = Field(description="A file uploaded with purpose 'batch': one request per line (JSONL).")
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"] = Field(
        description="The endpoint every line is sent to.")
    completion_window: Literal["24h"] = Field(description="Only '24h'.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs.")

    @model_validator(mode="after")
    def _check(self) -> CreateBatch:
        check_metadata(self.metadata)
        return self


def new_batch(request: CreateBatch, batch_id: str, now: float) -> dict[str, Any]:
    """The Batch object of a batch just created (validating)."""
    created = int(now)
    return {"id": batch_id, "object": "batch", "endpoint": request.endpoint, "errors": None,
            "input_file_id": request.input_file_id, "completion_window": request.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": created,
            "in_progress_at": None, "expires_at": created + COMPLETION_WINDOW_S, "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": dict(request.metadata or {}),
            "model": None, "usage": None}


def moved(batch: dict[str, Any], status: str, **fields: Any) -> dict[str, Any]:
    """``batch`` in ``status``, its ``<status>_at`` time set (and ``fields``)."""
    stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
             "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
             "cancelled": "cancelled_at"}.get(status)
    out = {**batch, "status": status, **fields}
    if stamp is not None and out.get(stamp) is None:
        out[stamp] = int(time.time())
    return out


def no_usage() -> dict[str, Any]:
    """A batch's ``usage`` before any line was answered."""
    return {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}


def _count(usage: dict[str, Any], key: str, detail: str | None = None) -> int:
    value = usage.get(key)
    if detail is not None:
        value = value.get(detail) if isinstance(value, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def add_usage(usage: dict[str, Any] | None, result: dict[str, Any]) -> dict[str, Any]:
    """A batch's ``usage`` with the output or error file line ``result`` added: a 2xx answer's tokens, whichever
    endpoint answered (Responses: ``input_tokens``/``output_tokens``; chat, completions and embeddings:
    ``prompt_tokens``/``completion_tokens``, embeddings without the latter); any other line adds nothing.

    NOTE(server): total_tokens is input + output, not the lines' own totals summed (the same where every endpoint
    keeps total = input + output, as ours do).
    """
    usage = usage or no_usage()
    response = result.get("response") or {}
    body, status = response.get("body"), response.get("status_code")
    line = body.get("usage") if isinstance(body, dict) and isinstance(status, int) and 200 <= status < 300 else None
    if not isinstance(line, dict):
        return usage
    if "input_tokens" in line:  # /v1/responses
        keys = ("input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details")
    else:
        keys = ("prompt_tokens", "prompt_tokens_details", "completion_tokens", "completion_tokens_details")
    input_tokens = usage["input_tokens"] + _count(line, keys[0])
    output_tokens = usage["output_tokens"] + _count(line, keys[2])
    cached = usage["input_tokens_details"]["cached_tokens"] + _count(line, keys[1], "cached_tokens")
    reasoning = usage["output_tokens_details"]["reasoning_tokens"] + _count(line, keys[3], "reasoning_tokens")
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens}


def answered_model(result: dict[str, Any]) -> str | None:
    """The model that answered the output file line ``result`` (its body's ``model``), if it says."""
    body = (result.get("response") or {}).get("body")
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def batch_errors(code: str, message: str, line: int | None = None) -> dict[str, Any]:
    """The ``errors`` of a batch that failed as a whole (its file could not be read as a batch)."""
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": line}]}


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error file line for a line that was never sent (it did not parse, or asked what a batch cannot do)."""
    return {"id": _line_id(), "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def result_line(custom_id: str, status: int, body: Any, request_id: str) -> dict[str, Any]:
    """An output (2xx) or error file line: the endpoint's answer as it would have been over HTTP."""
    return {"id": _line_id(), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def parse_line(text: str, endpoint: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the request, None) of one input line, or (None, its error file line).

    A line is ``{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {...}}``.
    """
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, error_line(None, "invalid_json_line", f"This line is not valid JSON: {exc}")
    if not isinstance(data, dict):
        return None, error_line(None, "invalid_json_line", "Each line must be a JSON object.")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, error_line(None, "missing_custom_id", "Each line needs a custom_id (a non-empty string).")
    problem = None
    if data.get("method", "POST") != "POST":
        problem = ("invalid_method", f"method must be 'POST', got {data.get('method')!r}")
    elif data.get("url") != endpoint:
        problem = ("invalid_url", f"url must be the batch's endpoint {endpoint!r}, got {data.get('url')!r}")
    elif not isinstance(data.get("body"), dict):
        problem = ("invalid_body", "body must be a JSON object (the endpoint's request)")
    elif data["body"].get("stream"):
        problem = ("invalid_body", "stream is not supported in a batch (each line's answer is kept whole)")
    if problem is not None:
        return None, error_line(custom_id, *problem)
    return {"custom_id": custom_id, "body": data["body"]}, None


def unknown_file(file_id: str) -> InvalidRequestError:
    return InvalidRequestError(f"input_file_id {file_id!r} is not a file of purpose 'batch'", param="input_file_id",
                               code="invalid_value")
