"""The chat request's messages and tool definitions, as OpenAI spells them (validated at the edge)."""

from __future__ import annotations

import re
from typing import Any, Literal

import jsonschema
from pydantic import Field, field_validator, model_validator

from engine.types import InvalidRequestError
from server.openai.base import OpenAIBaseModel, _unsupported


class FunctionCall(OpenAIBaseModel):
    name: str = Field(description="The function called.")
    arguments: str | dict[str, Any] = Field(description="The arguments, as JSON text.")


class AssistantToolCall(OpenAIBaseModel):
    """A call in an assistant message of the history."""

    id: str = Field(description="The call's id; the tool message that answers it repeats it.")
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        description="Who wrote the message ('developer' is treated as 'system'; 'tool' answers a tool call)."
    )
    content: str | list[dict[str, Any]] | None = Field(
        None, description="A string or an array of {'type': 'text', 'text': ...} parts."
    )
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, description="Calls an assistant message made.")
    tool_call_id: str | None = Field(None, description="In a tool message: the id of the call it answers.")
    reasoning_content: str | None = Field(None, description="In an assistant message: its thinking (templates "
                                          "that render past thinking show it).")
    reasoning: str | None = Field(None, description="The same as reasoning_content (vLLM's and Ollama's name).")

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
        if self.role == "function":
            raise _unsupported("role", "'function' messages (the deprecated functions API) are not supported; "
                                       "use tools and 'tool' messages")
        if self.tool_calls and self.role != "assistant":
            raise _unsupported("tool_calls", f"only assistant messages carry tool_calls, not {self.role}",
                               code="invalid_value")
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequestError("a tool message needs the tool_call_id of the call it answers",
                                      param="tool_call_id", code="missing_required_parameter")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The content as one string: text parts joined by a newline.

        NOTE(chat): the chat template takes a string, so the parts must be joined, and how shapes what the model
        reads: vLLM and llama.cpp's server put a newline between them, and so does this server (joined without
        one, Qwen Code's ``</system-reminder>`` part ran straight into the user's task, and the 1.5B model went on
        writing reminders instead of answering; docs/agents.md).
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)


_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# Deeper parameter schemas are refused before anything walks them recursively (the schema check, the grammar).
MAX_SCHEMA_DEPTH = 64


def _nesting_depth(value: Any) -> int:
    """How deep JSON containers nest in ``value`` (iterative: a hostile depth cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(description="a-z, A-Z, 0-9, '_' and '-', at most 64 characters.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments (none: no arguments).")
    strict: bool | None = Field(None, description="true: calls follow the schema exactly, or the request is a 400 "
                                                  "naming the keyword the grammar cannot enforce; otherwise what "
                                                  "cannot be enforced is left out (and logged).")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _FUNCTION_NAME.match(value):
            raise InvalidRequestError(f"function names are 1-64 characters of a-z, A-Z, 0-9, '_' and '-', "
                                      f"got {value!r}", code="invalid_value")
        return value

    @field_validator("parameters")
    @classmethod
    def _check_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        depth = _nesting_depth(value)
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"parameters nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are "
                                      "supported", code="invalid_value")
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except RecursionError:
            raise InvalidRequestError("parameters nests too deeply to be checked", code="invalid_value") from None
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.path)
            raise InvalidRequestError(f"parameters is not a valid JSON Schema: {exc.message}"
                                      + (f" (at {where})" if where else ""), code="invalid_value") from None
        if value.get("type", "object") != "object":
            raise InvalidRequestError(f"parameters must describe an object (the arguments), got type "
                                      f"{value.get('type')!r}", code="invalid_value")
        return value


class ToolDefinition(OpenAIBaseModel):
    type: Literal["function"] = Field(description="Only function tools exist.")
    function: FunctionDefinition


class NamedToolChoice(OpenAIBaseModel):
    class Function(OpenAIBaseModel):
        name: str

    type: Literal["function"]
    function: Function
