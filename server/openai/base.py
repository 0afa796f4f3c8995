"""The base of every OpenAI-compatible wire model: unknown fields accepted and logged, null as absent, strict
types; and the error a request field the server does not offer raises. No onnxruntime import.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.types import InvalidRequestError

logger = logging.getLogger(__name__)


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
