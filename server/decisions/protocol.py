"""The wire formats of this package: OpenAI's POST /v1/decisions (as the openai SDK types it: ``client.decisions.
create``) and System One's POST /v1/systemone, each converted to ``Question``s and chat messages, and their answers
back. Validation errors name the field (400). Must not import onnxruntime or any engine module but engine.types.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from engine.types import InvalidRequestError
from server.decisions.questions import (
    MAX_OPTIONS,
    Distribution,
    LabelSet,
    Option,
    Question,
)
from server.openai.base import OpenAIBaseModel

MAX_QUESTIONS = 400  # OpenAI's bound; System One's too


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def _text(value: Any, param: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str):
        raise _bad(f"{param} must be a string, got {type(value).__name__}", param, "invalid_type")
    if not value.strip():
        raise _bad(f"{param} must not be empty", param)
    return value


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2)


def _parts_text(content: Any, param: str, allowed: Sequence[str]) -> str:
    """A message's content (a string, or a list of parts) as text; images are refused (text-only models)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _bad(f"{param} must be a string or a non-empty list of content parts", param, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise _bad(f"{p}.type must be one of {list(allowed)}, got {kind!r}", f"{p}.type")
        if kind == "input_image":
            raise _bad(f"{p} is an image; this server's models read text only", p, "unsupported_content")
        if kind == "input_json":
            if "data" not in part or not isinstance(part["data"], (dict, list)):
                raise _bad(f"{p}.data must be a JSON object or a list of objects", f"{p}.data", "invalid_type")
            texts.append(_json_text(part["data"]))
        else:
            key = "refusal" if kind == "refusal" else "text"
            texts.append(_text(part.get(key), f"{p}.{key}"))
    return "\n\n".join(texts)


def _merged(messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Consecutive messages of one role as one (templates that insist on alternating roles take the result)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1]["content"] += "\n\n" + m["content"]
        else:
            out.append(dict(m))
    return out


_ROLES = {"user": "user", "developer": "system", "system": "system", "assistant": "assistant"}
_USER_PARTS = ("input_text", "input_image", "input_json")


def input_messages(value: Any, param: str = "input") -> list[dict[str, Any]]:
    """OpenAI's decision ``input`` (a string, or messages, function calls and custom tool calls with their outputs)
    as chat messages. Calls become assistant text, their outputs user text."""
    if isinstance(value, str):
        return [{"role": "user", "content": _text(value, param)}]
    if not isinstance(value, list):
        raise _bad(f"{param} must be a string or a list of input items, got {type(value).__name__}", param,
                   "invalid_type")
    if not value:
        raise _bad(f"{param} must not be empty", param)
    messages: list[dict[str, str]] = []
    calls: dict[str, str] = {}
    for i, item in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{p} must be an object", p, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{p}.role must be one of {list(_ROLES)}, got {role!r}", f"{p}.role")
            allowed = ("output_text", "refusal") if role == "assistant" else (
                _USER_PARTS if role == "user" else ("input_text",))
            messages.append({"role": _ROLES[role], "content": _parts_text(item.get("content"), f"{p}.content", allowed)})
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = _text(item.get("call_id"), f"{p}.call_id"), _text(item.get("name"), f"{p}.name")
            args = item.get("arguments") if kind == "function_call" else item.get("input")
            if not isinstance(args, str):
                key = "arguments" if kind == "function_call" else "input"
                raise _bad(f"{p}.{key} must be a string", f"{p}.{key}", "invalid_type")
            calls[call_id] = name
            messages.append({"role": "assistant", "content": f"Called the tool {name} with: {args}"})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _text(item.get("call_id"), f"{p}.call_id")
            if call_id not in calls:
                raise _bad(f"{p}.call_id {call_id!r} matches no earlier call in input", f"{p}.call_id")
            output = _parts_text(item.get("output"), f"{p}.output", ("input_text", "input_image"))
            messages.append({"role": "user", "content": f"The tool {calls[call_id]} returned: {output}"})
        else:
            raise _bad(f"{p}.type {kind!r} is not a decision input item", f"{p}.type")
    return _merged(messages)


def _instructions(value: Any, param: str) -> str:
    if isinstance(value, list):
        return _parts_text(value, param, ("input_text", "input_image", "input_json"))
    return _text(value, param)


def _check_count(items: Any, param: str, what: str, low: int, high: int) -> list[Any]:
    if not isinstance(items, list):
        raise _bad(f"{param} must be a list of {what}", param, "invalid_type")
    if not low <= len(items) <= high:
        raise _bad(f"{param} must hold {low} to {high} {what}, got {len(items)}", param)
    return items


def openai_question(item: Any, param: str) -> tuple[Question, str | None]:
    """One of OpenAI's ``questions`` (predicate, choice, score) and its ``name``."""
    if not isinstance(item, dict):
        raise _bad(f"{param} must be an object", param, "invalid_type")
    kind, name = item.get("type"), item.get("name")
    if name is not None and not isinstance(name, str):
        raise _bad(f"{param}.name must be a string", f"{param}.name", "invalid_type")
    text = _instructions(item.get("instructions"), f"{param}.instructions")
    if kind == "predicate":
        return Question("predicate", text), name
    if kind == "choice":
        choices = _check_count(item.get("choices"), f"{param}.choices", "choices", 2, MAX_OPTIONS)
        options, seen = [], set()
        for j, choice in enumerate(choices):
            p = f"{param}.choices[{j}]"
            value = choice.get("value") if isinstance(choice, dict) else None
            if not isinstance(value, (str, bool)):
                raise _bad(f"{p}.value must be a string or a boolean", f"{p}.value", "invalid_type")
            key = (type(value), value)  # NOTE(server): typed: "true" and true are two choices
            if key in seen:
                raise _bad(f"{param}.choices must be unique; {p}.value {value!r} repeats an earlier one",
                           f"{param}.choices")
            seen.add(key)
            description = choice.get("description")
            if description is not None and not isinstance(description, str):
                raise _bad(f"{p}.description must be a string", f"{p}.description", "invalid_type")
            options.append(Option(json.dumps(value) if isinstance(value, bool) else value, description))
        return Question("choice", text, tuple(options)), name
    if kind == "score":
        levels = _check_count(item.get("levels"), f"{param}.levels", "levels", 2, MAX_OPTIONS)
        options = []
        for j, level in enumerate(levels):
            p = f"{param}.levels[{j}]"
            if not isinstance(level, dict):
                raise _bad(f"{p} must be an object with a label", p, "invalid_type")
            description = level.get("description")
            if description is not None and not isinstance(description, str):
                raise _bad(f"{p}.description must be a string", f"{p}.description", "invalid_type")
            options.append(Option(_text(level.get("label"), f"{p}.label"), description))
        return Question("score", text, tuple(options)), name
    raise _bad(f"{param}.type must be 'predicate', 'choice' or 'score', got {kind!r}", f"{param}.type")


class DecisionRequest(OpenAIBaseModel):
    """POST /v1/decisions: OpenAI's Decisions API (openai.types.DecisionCreateParams)."""

    model: str | None = Field(None, description="The chat model (default: the server's).")
    input: Any = Field(description="A string, or an ordered list of messages, function calls and their outputs.")
    questions: Any = Field(description="1 to 400 predicate, choice or score questions, answered in order.")
    prompt_cache_key: str | None = Field(None, description="Accepted; every request reuses prefixes already.")
    prompt_cache_options: Any = Field(None, description="Accepted, not used.")
    safety_identifier: str | None = Field(None, description="Accepted, not used.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="More chat template variables (thinking is off unless this turns it on).")
    _messages: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _questions: list[tuple[Question, str | None]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _parse(self) -> DecisionRequest:
        self._messages = input_messages(self.input)
        items = _check_count(self.questions, "questions", "questions", 1, MAX_QUESTIONS)
        self._questions = [openai_question(q, f"questions[{i}]") for i, q in enumerate(items)]
        return self

    def messages(self) -> list[dict[str, Any]]:
        return self._messages

    def parsed_questions(self) -> list[tuple[Question, str | None]]:
        return self._questions


def _choice_value(question_item: dict[str, Any], index: int) -> str | bool:
    return question_item["choices"][index]["value"]


def openai_answer(item: dict[str, Any], name: str | None, answer: tuple[Distribution, LabelSet] | None) -> dict:
    """One answer of OpenAI's ``Decision.answers``."""
    if answer is None:
        return {"type": "refusal", "name": name}
    dist, _ = answer
    p = dist.probabilities
    kind = item["type"]
    if kind == "predicate":
        return {"type": "predicate", "name": name, "probability": p[0]}
    if kind == "choice":
        return {"type": "choice", "name": name, "choice": _choice_value(item, dist.best), "confidence": dist.confidence,
                "probabilities": [{"value": _choice_value(item, i), "probability": p[i]} for i in range(len(p))]}
    return {"type": "score", "name": name, "score": dist.expected_index, "confidence": dist.confidence,
            "probabilities": [{"label": item["levels"][i]["label"], "value": i, "probability": p[i]}
                              for i in range(len(p))]}


def openai_usage(num_input: int, num_cached: int) -> dict[str, Any]:
    return {"input_tokens": num_input,
            "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": num_input - num_cached},
            "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": num_input}


# --- System One ----------------------------------------------------------------------------------------------------


def _state_text(state: Any) -> str:
    if isinstance(state, str):
        return _text(state, "state")
    if isinstance(state, (dict, list)) and state:
        return _json_text(state)
    raise _bad("state must be a non-empty string, JSON object or list", "state",
               "invalid_type" if not isinstance(state, (dict, list)) else "invalid_value")


def systemone_question(item: Any, param: str) -> Question:
    """One of System One's questions: noul (criteria: optional {"true", "false"} descriptions), choice (criteria: option
    key -> description or null) or score (criteria: levels, lowest first)."""
    if not isinstance(item, dict):
        raise _bad(f"{param} must be an object", param, "invalid_type")
    kind = item.get("type")
    raw = item.get("instructions")
    text = _text(raw, f"{param}.instructions") if not isinstance(raw, (dict, list)) else _json_text(raw)
    criteria = item.get("criteria")
    if kind == "noul":
        if criteria is not None and not isinstance(criteria, dict):
            raise _bad(f"{param}.criteria must be an object with 'true' and 'false' descriptions",
                       f"{param}.criteria", "invalid_type")
        criteria = criteria or {}
        return Question("predicate", text, yes_means=criteria.get("true"), no_means=criteria.get("false"))
    if kind == "choice":
        if not isinstance(criteria, dict):
            raise _bad(f"{param}.criteria must map each option to its description (or null)", f"{param}.criteria",
                       "invalid_type")
        if not 2 <= len(criteria) <= MAX_OPTIONS:
            raise _bad(f"{param}.criteria must hold 2 to {MAX_OPTIONS} options, got {len(criteria)}",
                       f"{param}.criteria")
        options = []
        for key, description in criteria.items():
            if description is not None and not isinstance(description, str):
                raise _bad(f"{param}.criteria[{key!r}] must be a string or null", f"{param}.criteria.{key}",
                           "invalid_type")
            options.append(Option(key, description))
        return Question("choice", text, tuple(options))
    if kind == "score":
        levels = _check_count(criteria, f"{param}.criteria", "levels", 2, MAX_OPTIONS)
        return Question("score", text, tuple(Option(_text(level, f"{param}.criteria[{j}]"))
                                             for j, level in enumerate(levels)))
    raise _bad(f"{param}.type must be 'noul', 'choice' or 'score', got {kind!r}", f"{param}.type")


class SystemOneRequest(OpenAIBaseModel):
    """POST /v1/systemone: TypeSafe's System One format (a state and named questions)."""

    model: str | None = Field(None, description="The chat model (default: the server's).")
    state: Any = Field(description="What the questions are about: a string, or a JSON object or list.")
    questions: Any = Field(description="Question name -> noul, choice or score question (1 to 400).")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="More chat template variables.")
    images: Any = Field(None, description="Refused: this server's models read text only.")
    videos: Any = Field(None, description="Refused: this server's models read text only.")
    _messages: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _questions: list[tuple[str, Question]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _parse(self) -> SystemOneRequest:
        for name in ("images", "videos"):
            if getattr(self, name):  # NOTE(server): refused, never dropped: the answer would ignore what was sent
                raise _bad(f"{name} cannot be read: this server's models read text only", name,
                           "unsupported_content")
        self._messages = [{"role": "user", "content": _state_text(self.state)}]
        if not isinstance(self.questions, dict):
            raise _bad("questions must be an object mapping names to questions", "questions", "invalid_type")
        if not 1 <= len(self.questions) <= MAX_QUESTIONS:
            raise _bad(f"questions must hold 1 to {MAX_QUESTIONS} questions, got {len(self.questions)}", "questions")
        self._questions = [(name, systemone_question(q, f"questions.{name}")) for name, q in self.questions.items()]
        return self

    def messages(self) -> list[dict[str, Any]]:
        return self._messages

    def parsed_questions(self) -> list[tuple[str, Question]]:
        return self._questions


def systemone_answer(question: Question, answer: tuple[Distribution, LabelSet]) -> dict[str, Any]:
    dist, _ = answer
    p = dist.probabilities
    if question.kind == "predicate":
        return {"type": "noul", "noul": p[0]}
    if question.kind == "choice":
        keys = [o.text for o in question.options]
        return {"type": "choice", "choice": keys[dist.best], "confidence": dist.margin_confidence,
                "probabilities": dict(zip(keys, p))}
    return {"type": "score", "score": dist.expected_index, "confidence": dist.margin_confidence,
            "legend": {str(i): o.text for i, o in enumerate(question.options)},
            "probabilities": {str(i): p[i] for i in range(len(p))}}
