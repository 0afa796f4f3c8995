"""Structured-output request fields on the wire: OpenAI's response_format, vLLM's structured_outputs and
guided_* fields, llama.cpp's json_schema and grammar; all become one engine.types.StructuredOutput.

Part of the wire layer beside server/openai/protocol.py (which mixes StructuredOutputFields into its requests).
Imports only pydantic and engine.types; whether a spec compiles is the engine's to say (a 400 naming the
field, raised before any streaming).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.types import InvalidRequestError, StructuredOutput

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# vLLM's structured_outputs keys that select a constraint (the others, e.g. whitespace_pattern or backend,
# are tuning knobs this server does not need: JSON is always compact).
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "gbnf",
               "json_object": "json_object"}


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_value")


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object (or true) or as JSON text -> JSON text."""
    if isinstance(value, str):
        return value  # parsed, and refused if it is not a schema, by the engine
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise _bad(param, f"{param} must be a JSON schema (an object), got {type(value).__name__}")


def _choice_text(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise _bad(param, f"{param} must be a non-empty list of strings, got {json.dumps(value)[:80]}")
    return json.dumps(value)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(param, f"{param} must be a non-empty string")
    return value


def from_response_format(value: dict[str, Any], param: str = "response_format") -> StructuredOutput | None:
    """OpenAI's response_format (and llama.cpp's json_object with a "schema") -> a constraint or None (text)."""
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        # NOTE(server): llama.cpp's server takes {"type": "json_object", "schema": {...}} as a schema.
        if value.get("schema") is not None:
            return StructuredOutput("json_schema", _schema_text(value["schema"], f"{param}.schema"), param=param)
        return StructuredOutput("json_object", param=param)
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict):
            raise _bad(param, f"{param}.json_schema must be an object with 'name' and 'schema' when type is "
                              f"'json_schema'")
        if "name" in body and not isinstance(body["name"], str):
            raise _bad(param, f"{param}.json_schema.name must be a string")
        # NOTE(server): "strict" is accepted either way: the schema is always enforced, never just a hint.
        schema = body.get("schema", True)  # OpenAI allows no schema: any JSON value
        return StructuredOutput("json_schema", _schema_text(schema, f"{param}.json_schema.schema"), param=param)
    raise InvalidRequestError(f"{param}.type must be one of {list(_RESPONSE_FORMAT_TYPES)}, got {kind!r}",
                              param=param, code="unsupported_value")


def from_vllm_structured_outputs(value: dict[str, Any], param: str = "structured_outputs") -> StructuredOutput:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    if value.get("structural_tag") is not None:
        raise InvalidRequestError(f"{param}.structural_tag is not supported (use grammar with a Lark grammar)",
                                  param=param, code="unsupported_parameter")
    chosen = [key for key in _VLLM_KINDS if value.get(key) not in (None, False)]
    if len(chosen) != 1:
        raise _bad(param, f"{param} must set exactly one of {list(_VLLM_KINDS)}, got {chosen or 'none'}")
    key = chosen[0]
    spec = value[key]
    where = f"{param}.{key}"
    if key == "json":
        return StructuredOutput("json_schema", _schema_text(spec, where), param=param)
    if key == "choice":
        return StructuredOutput("choice", _choice_text(spec, where), param=param)
    if key == "json_object":
        return StructuredOutput("json_object", param=param)
    return StructuredOutput(_VLLM_KINDS[key], _text(spec, where), param=param)


class StructuredOutputFields(BaseModel):
    """The structured-output fields that chat and completions requests share (mixed into both)."""

    model_config = ConfigDict(extra="allow", strict=True)  # as server.openai.base.OpenAIBaseModel

    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {'name', 'schema', "
                          "'strict'}}: the answer is JSON (matching the schema).")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM: exactly one of {'json': schema, 'regex': str, 'choice': [str], 'grammar': str, "
                          "'json_object': true}.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM (older name): a JSON schema.")
    guided_regex: str | None = Field(None, description="vLLM (older name): a regular expression.")
    guided_choice: list[str] | None = Field(None, description="vLLM (older name): the answer is one of these.")
    guided_grammar: str | None = Field(None, description="vLLM (older name): a GBNF or Lark grammar.")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp: a JSON schema.")
    grammar: str | None = Field(None, description="llama.cpp: a GBNF grammar.")

    @model_validator(mode="after")
    def _check_structured(self) -> StructuredOutputFields:
        self.structured_output()  # malformed fields are refused with the body, before any engine work
        return self

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint this request asks for, or None.

        Raises:
            InvalidRequestError: a malformed field, or more than one constraint (named by the second field).
        """
        found: list[StructuredOutput] = []
        if self.response_format is not None:
            spec = from_response_format(self.response_format)
            if spec is not None:
                found.append(spec)
        if self.structured_outputs is not None:
            found.append(from_vllm_structured_outputs(self.structured_outputs))
        if self.guided_json is not None:
            found.append(StructuredOutput("json_schema", _schema_text(self.guided_json, "guided_json"),
                                          param="guided_json"))
        if self.guided_regex is not None:
            found.append(StructuredOutput("regex", _text(self.guided_regex, "guided_regex"), param="guided_regex"))
        if self.guided_choice is not None:
            found.append(StructuredOutput("choice", _choice_text(self.guided_choice, "guided_choice"),
                                          param="guided_choice"))
        if self.guided_grammar is not None:
            found.append(StructuredOutput("gbnf", _text(self.guided_grammar, "guided_grammar"),
                                          param="guided_grammar"))
        if self.json_schema is not None:
            found.append(StructuredOutput("json_schema", _schema_text(self.json_schema, "json_schema"),
                                          param="json_schema"))
        if self.grammar is not None:
            found.append(StructuredOutput("gbnf", _text(self.grammar, "grammar"), param="grammar"))
        if len(found) > 1:
            raise InvalidRequestError(f"a request takes one output constraint, got {found[0].param} and "
                                      f"{found[1].param}", param=found[1].param, code="invalid_value")
        return found[0] if found else None
