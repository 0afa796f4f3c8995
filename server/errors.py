"""Exception class -> HTTP status and OpenAI error JSON, for every error the server can answer with.

Maps by class, never by message text. No stack trace ever reaches a client. No onnxruntime import.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.types import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
)
from server.metrics import REJECTED
from server.openai.protocol import error_body
from server.anthropic.protocol import from_openai_error as anthropic_error
from server.anthropic.protocol import is_anthropic_path

logger = logging.getLogger(__name__)


class ServerError(Exception):
    """An error the server raises itself, with its HTTP status and OpenAI `type`/`code`."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.headers = headers or {}


class ModelNotFoundError(ServerError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, requested: str, served: str, also: list[str] | None = None) -> None:
        names = " and ".join(repr(n) for n in dict.fromkeys([served, *(also or [])]))
        super().__init__(
            f"The model {requested!r} does not exist; this server serves {names}.",
            param="model", code="model_not_found",
        )


class ModelCannotError(ServerError):
    """The named model exists but cannot do what the request asks (chat on an encoder, embeddings on a chat
    model served without pooling)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="model_not_supported")


class NotFoundError(ServerError):
    """An id the state store does not hold (never made, deleted, or past the retention): 404."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, kind: str, object_id: str, param: str) -> None:
        super().__init__(f"No {kind} found with id {object_id!r}.", param=param, code="not_found")


class ResponseNotFoundError(NotFoundError):
    """GET/DELETE /v1/responses/{id} for an id the store does not hold (never stored, deleted or swept)."""

    def __init__(self, response_id: str) -> None:
        super().__init__("response", response_id, "response_id")


class TooLargeError(ServerError):
    """An upload past --file-max-bytes: 413."""

    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str = "file") -> None:
        super().__init__(message, param=param, code="file_too_large")


class ConflictError(ServerError):
    """The object is not in a state the request can act on (cancel a finished batch): 400, as OpenAI answers."""

    status_code = 400
    error_type = "invalid_request_error"


class EngineNotReadyError(ServerError):
    status_code = 503
    error_type = "service_unavailable"


# HTTP status -> OpenAI `type` for Starlette's own HTTPExceptions (unknown route, wrong method, ...).
_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple", "json-or-python"}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content' (union branch tags dropped)."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            else:
                parts.append(f"[{item}]")
        elif isinstance(item, str) and _IDENT.match(item) and item not in _TYPE_TAGS:
            parts.append(item)
    return ".".join(parts) or None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validation_error_response(exc: RequestValidationError) -> tuple[int, dict[str, Any]]:
    """FastAPI's request validation error -> 400 naming the first bad field (never the bare 422)."""
    errors = list(exc.errors())
    if not errors:
        return 400, error_body("invalid request", "invalid_request_error")
    first = errors[0]
    kind = first.get("type", "")
    loc = tuple(first.get("loc", ()))
    ctx = first.get("ctx") or {}
    cause = ctx.get("error")
    param = _loc_to_param(loc)
    if kind == "json_invalid":
        detail = ctx.get("error", "")
        return 400, error_body(f"The request body is not valid JSON ({detail}).", "invalid_request_error",
                               None, "invalid_json")
    if kind == "missing" and loc in (("body",), ()):
        return 400, error_body("The request needs a JSON body.", "invalid_request_error", None, "missing_body")
    if isinstance(cause, InvalidRequestError):
        if cause.param:
            param = f"{param}.{cause.param}" if param else cause.param
        return 400, error_body(str(cause), "invalid_request_error", param, cause.code)
    message = str(first.get("msg", "invalid value"))
    if kind == "missing":
        message = f"'{param}' is a required property"
        code = "missing_required_parameter"
    else:
        message = message.removeprefix("Value error, ")
        if "input" in first and not isinstance(first["input"], (dict, list)):
            message = f"{message}, got {_short(first['input'])}"
        message = f"{param}: {message}" if param else message
        code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    if len(errors) > 1 and kind != "missing":
        message += f" ({len(errors) - 1} more problem(s))"
    return 400, error_body(message, "invalid_request_error", param, code)


def _unparsable_body(exc: StarletteHTTPException) -> str | None:
    """The message for a body FastAPI could not parse for a reason other than a JSON syntax error (its bare
    400 "There was an error parsing the body"), or None when `exc` is something else."""
    if exc.status_code != 400:
        return None
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return (f"The request body is not valid JSON: it is not UTF-8 text (byte 0x{cause.object[cause.start]:02x} "
                f"at offset {cause.start}).")
    if isinstance(cause, RecursionError):
        return "The request body cannot be parsed: its JSON is nested too deeply."
    if isinstance(cause, ValueError):  # json.loads' only other ValueError: an integer past the digit limit
        return (f"The request body cannot be parsed: a number in it has more than {sys.get_int_max_str_digits()} "
                f"digits.")
    return None


def error_for(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI error body, extra headers) for any exception, by class.

    Used by the exception handlers and by streaming.py for an error event inside a stream.
    """
    if isinstance(exc, ServerError):
        return exc.status_code, error_body(str(exc), exc.error_type, exc.param, exc.code), exc.headers
    if isinstance(exc, RequestValidationError):
        status, body = validation_error_response(exc)
        return status, body, {}
    if isinstance(exc, InvalidRequestError):  # includes PromptTooLongError
        return 400, error_body(str(exc), "invalid_request_error", exc.param, exc.code), {}
    if isinstance(exc, EngineOverloadedError):
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        return 429, error_body(str(exc), "rate_limit_error", None, "server_overloaded"), {"Retry-After": retry_after}
    if isinstance(exc, (EngineDeadError, ModelLoadError)):
        return 503, error_body(f"The engine is not available: {exc}", "service_unavailable", None,
                               "engine_unavailable"), {}
    if isinstance(exc, EngineError):
        return 500, error_body(f"The engine failed: {exc}", "internal_error", None, "engine_error"), {}
    if isinstance(exc, StarletteHTTPException) and (message := _unparsable_body(exc)) is not None:
        return 400, error_body(message, "invalid_request_error", None, "invalid_json"), {}
    if isinstance(exc, StarletteHTTPException):
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed",
                408: "request_timeout"}.get(exc.status_code)
        return exc.status_code, error_body(str(exc.detail), _HTTP_TYPES.get(exc.status_code, "server_error"),
                                           None, code), dict(exc.headers or {})
    # NOTE(server): anything else is our bug; the client gets no details, the log gets the traceback.
    return 500, error_body("Internal server error.", "internal_error", None, "internal_error"), {}


def json_error(exc: BaseException, path: str = "") -> JSONResponse:
    """The error response for ``exc``: OpenAI's shape, or Anthropic's on the Messages routes (``path``)."""
    status, body, headers = error_for(exc)
    return _response(status, body, headers, path, exc)


def shaped_error(status: int, body: dict[str, Any], path: str, exc: BaseException | None = None) -> dict[str, Any]:
    """An OpenAI error ``body`` in the shape of ``path``'s API: Anthropic's on the Messages routes, Ollama's
    (``{"error": "message"}``, which its clients raise as ResponseError) on its native /api/ routes."""
    if is_anthropic_path(path):
        return anthropic_error(status, body, exc)
    if path.startswith("/api/"):
        return {"error": body["error"]["message"]}
    return body


# NOTE(server): System One (as Jev and llama.cpp define it) answers a request it cannot validate with 422
# unprocessable_entity_error, where OpenAI's APIs answer 400.
UNPROCESSABLE_PATHS = frozenset({"/v1/systemone"})


def _response(status: int, body: dict[str, Any], headers: dict[str, str], path: str,
              exc: BaseException | None = None) -> JSONResponse:
    if status == 400 and path in UNPROCESSABLE_PATHS:
        status = 422
        body = {"error": {**body["error"], "type": "unprocessable_entity_error"}}
    return JSONResponse(shaped_error(status, body, path, exc), status_code=status, headers=headers)


async def _handle_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    path = request.url.path
    if exc.status_code in (404, 405):
        status, body, headers = error_for(exc)
        body["error"]["message"] = (f"Unknown route: {request.method} {path}" if exc.status_code == 404
                                    else f"Method {request.method} is not allowed on {path}")
        return _response(status, body, headers, path)
    return json_error(exc, path)


# Generation routes whose outcomes ortserve_requests_total counts.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
# Embedding routes, counted by ortserve_embedding_requests_total.
EMBEDDING_PATHS = frozenset({"/v1/embeddings", "/embedding", "/embeddings"})


# Readout routes (decisions, rerank, score) -> their endpoint label of ortserve_readout_requests_total.
READOUT_PATHS = {"/v1/decisions": "decisions", "/v1/systemone": "systemone", "/v1/rerank": "rerank",
                 "/rerank": "rerank", "/v2/rerank": "rerank", "/v1/score": "score", "/score": "score"}


def _count_outcome(request: Request, status: int) -> None:
    """Count a generation request that ended in an error before the engine recorded it."""
    if request.url.path in READOUT_PATHS:
        state = getattr(request.app.state, "ortserve", None)
        if state is not None and status != 499:
            state.metrics.readout_requests.labels(state.metric_model(request), READOUT_PATHS[request.url.path],
                                                  REJECTED if status < 500 else "error").inc()
        return
    if request.url.path in EMBEDDING_PATHS:
        state = getattr(request.app.state, "ortserve", None)
        if state is not None:
            state.metrics.embedding_requests.labels(state.metric_model(request, "embedding"),
                                                    REJECTED if status < 500 else "error").inc()
        return
    if request.url.path not in GENERATION_PATHS or status == 499:
        return
    outcome = REJECTED if status < 500 else "error"
    tracker = getattr(request.state, "ortserve_tracker", None)
    if tracker is not None:
        tracker.finish(outcome)  # no-op when the engine side already recorded this request
        return
    state = getattr(request.app.state, "ortserve", None)
    if state is not None:
        state.metrics.requests.labels(state.metric_model(request), outcome).inc()


async def _handle_any(request: Request, exc: Exception) -> JSONResponse:
    status, _, _ = error_for(exc)
    if status >= 500:
        expected = isinstance(exc, (ServerError, EngineError))
        logger.error("error while serving %s %s: %s", request.method, request.url.path, exc,
                     exc_info=None if expected else exc)
    _count_outcome(request, status)
    return json_error(exc, request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on `app`: validation, HTTP, engine, server and generic errors."""
    app.add_exception_handler(RequestValidationError, _handle_any)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _handle_http)  # type: ignore[arg-type]
    app.add_exception_handler(ServerError, _handle_any)  # type: ignore[arg-type]
    app.add_exception_handler(EngineError, _handle_any)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _handle_any)
