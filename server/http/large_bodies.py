"""A route class that parses and validates large JSON request bodies in a worker thread, off the event loop.

FastAPI decodes and validates a request body on the event loop. For a 4 MB body of 140,000 small messages
that is seconds of Python (pydantic calls each message's validators) during which no other stream gets a
byte. ``ThreadedBodyRoute`` does that work in the threadpool for bodies of at least ``THREADED_BODY_BYTES``:
the validators are Python, so the interpreter hands the GIL back to the loop every few milliseconds. The
route's signature, OpenAPI schema and errors stay FastAPI's: the validated model is handed to FastAPI's
own handler as the request's parsed JSON (revalidating a model instance is a no-op), and failures raise the
same RequestValidationError FastAPI would (loc under ``body``). Before validating, the app's
``app.state.ortserve_body_check`` (if set) sees the decoded JSON and may refuse it (an InvalidRequestError, e.g. a
conversation that can't fit the context by its message count alone). No onnxruntime import.
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from engine.types import InvalidRequestError

THREADED_BODY_BYTES = 256 * 1024  # smaller bodies validate in well under a millisecond per kilobyte


def _is_json(request: Request) -> bool:
    value = request.headers.get("content-type")
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The pydantic model of the route's (single, not embedded) JSON body, if it has one."""
    field = route.body_field
    annotation = getattr(getattr(field, "field_info", None), "annotation", None)
    if field is None or not isinstance(annotation, type) or not issubclass(annotation, BaseModel):
        return None
    return annotation if len(route.dependant.body_params) == 1 else None


def _validate(model: type[BaseModel], body: bytes, check: Callable[[Any], None] | None = None) -> BaseModel:
    """Worker thread: decode, ``check`` and validate, raising what FastAPI raises for the same body."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from exc
    if check is not None:
        check(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=data) from exc


class ThreadedBodyRoute(APIRoute):
    """An APIRoute whose large JSON bodies are decoded and validated in the threadpool (see the module)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return handler

        async def threaded(request: Request) -> Response:
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) >= THREADED_BODY_BYTES and _is_json(request):
                body = await request.body()
                try:
                    parsed: Any = await run_in_threadpool(_validate, model, body,
                                                          getattr(request.app.state, "ortserve_body_check", None))
                except (RequestValidationError, json.JSONDecodeError, InvalidRequestError):
                    raise
                except Exception:  # undecodable bytes and the like: FastAPI's own path says what is wrong
                    return await handler(request)
                # NOTE(server): Starlette's Request.json() returns `_json` once it is set; FastAPI's handler then
                # gets the validated model, which validating again returns as it is.
                request._json = parsed  # type: ignore[attr-defined]
            return await handler(request)

        return threaded
