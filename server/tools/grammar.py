"""Grammar building blocks shared by the tool-call formats (server.tools.formats): call schemas, the JSON rule,
the lazy trigger rules, the thinking prefix. Each format's own grammar lives in its class.

Text only: the engine compiles the grammar (StructuredOutput kind "lark"); this module never imports the
grammar library. `required` and a named function constrain the whole answer; `auto` leaves text free until
the format's trigger (a tag or special token) appears, then constrains the call (a lazy grammar), except in
the generic format, whose answer is always JSON: a call or {"response": text}.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.json_schema import LENIENT_JSON_OPTIONS, close_objects

# NOTE(tools): one JSON style everywhere: no free whitespace (a small model could spend its tokens on it),
# and ", " / ": " separators, as the models' own tool-call examples and json.dumps write JSON.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Free text in `auto`: anything (special tokens cannot appear in it: llguidance never matches them as text).
_TEXT = r"/(?s:.*)/"

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Trigger:
    """What opens a call in a native format: ``text`` (e.g. ``<tool_call>``), and the special token id
    when the tokenizer has it as one (then the grammar must name the token, not spell the text)."""

    text: str
    special_id: int | None = None

    def lark(self) -> str:
        return f"<[{self.special_id}]>" if self.special_id is not None else json.dumps(self.text)


def has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(has_ref(v) for v in node)
    return False


def rebase_refs(node: Any, base: str) -> Any:
    """A copy of ``node`` whose local JSON-pointer refs (``#``, ``#/...``) point under ``base`` (``#/$defs/tool0``)."""
    if isinstance(node, dict):
        out = {k: rebase_refs(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        # NOTE(tools): a JSON pointer (#/...) moves with the schema; an anchor (#name) names a $anchor, which
        # is found anywhere in the document, so it stays as it is.
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [rebase_refs(v, base) for v in node]
    return node


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameters schema; a function without one takes no arguments (as OpenAI defines it)."""
    params = function_of(tool).get("parameters")
    return EMPTY_PARAMETERS if params is None else params


def call_schema(tools: Sequence[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """JSON Schema of one call ``{"name": <const>, "<args_key>": <parameters>}`` to any of ``tools``.

    A parameters schema with local ``$ref``s moves under ``$defs`` (its refs rebased), so that it still
    resolves once embedded in this larger document.
    """
    defs: dict[str, Any] = {}
    alternatives = []
    for index, tool in enumerate(tools):
        params = parameters_of(tool)
        if has_ref(params):
            key = f"ortserve_tool{index}"
            defs[key] = rebase_refs(params, f"#/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        alternatives.append({
            "type": "object",
            "properties": {"name": {"const": function_of(tool)["name"]}, args_key: params},
            "required": ["name", args_key],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def json_rule(schema: dict[str, Any], *, lenient: bool = True) -> str:
    """``%json`` of ``schema`` in the tools' JSON style, objects closed.

    NOTE(tools): lenient by default (llguidance's lenient mode: what it cannot enforce is left out, the rest
    enforced): a tool's schema never refuses a turn. What must be exact (a strict tool, a response_format) is
    checked before the grammar is built (server.tools.plan), so lenient changes nothing for it.
    """
    style = {**_JSON_STYLE, **LENIENT_JSON_OPTIONS} if lenient else _JSON_STYLE
    return "%json " + json.dumps({**close_objects(schema), "x-guidance": style}, ensure_ascii=False)


def json_answer_grammar(schema: dict[str, Any]) -> str:
    """The whole answer is one JSON value following ``schema`` exactly (objects closed, the tools' JSON style)."""
    return f"start: {json_rule(schema, lenient=False)}\n"


def hoist_defs(schema: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    schema = dict(schema)
    return schema, schema.pop("$defs", {})


# NOTE(tools): after its last call a model writes a newline or two and then its end-of-generation token (Qwen2.5
# writes "</tool_call>\n<|endoftext|>"); the grammar lets it, instead of reading the newline as the start of
# another call. The end token itself is allowed by the engine's end-of-generation set (the grammar library is
# given the same set as the scheduler: engine.model_loader's eos_token_ids).
_END = r"ORTSERVE_END: /[ \t\r\n]{1,4}/"
# The opening of a call written without the format's markers (fenced or bare JSON): a lazy trigger too.
JSON_CALL_TRIGGER = r'\{[ \t\r\n]*"name"'


def tagged_start(trigger: Trigger, call_rule: str, *, required: bool, repeat: bool, separator: str,
                 response: dict[str, Any] | None = None, bare_rule: str | None = None) -> list[str]:
    """Rules that put calls ``<trigger> <call_rule>`` (repeated after ``separator`` when ``repeat``) in the
    answer: only calls when ``required``; otherwise free text first, and the trigger starts enforcement; with a
    ``response`` schema (a response_format beside the tools), either that JSON or calls, no text. Trailing
    whitespace may follow the last call (then the end-of-generation token).

    ``bare_rule`` (auto only): the rule for the rest of a call written without markers after its opening
    ``{"name"`` (see ``bare_call_rules``): that opening is a second lazy trigger, and the text after such a call
    is free.

    NOTE(tools): a special-token trigger cannot occur in free text (llguidance never matches special tokens
    as text), so text may simply run until it. A text trigger needs the free-text alternative to exclude it,
    and a lazy lexeme that ends at its first occurrence: from there the call is enforced.
    """
    trig = trigger.lark()
    more = f" ({json.dumps(separator) + ' ' if separator else ''}{trig} {call_rule})*" if repeat else ""
    calls = f"{call_rule}{more} ORTSERVE_END?"
    if required:
        return [f"start: {trig} {calls}", _END]
    if response is not None:
        return [f"start: answer | {trig} {calls}", f"answer: {json_rule(response)}", _END]
    excluded = [regex_escape(trigger.text)] if trigger.special_id is None else []
    if bare_rule is not None:
        excluded.append(JSON_CALL_TRIGGER)
    lines = [_END]
    if excluded:
        lines.append(f"PLAIN: {_TEXT} & ~/(?s:.*)({'|'.join(excluded)})(?s:.*)/")
    else:
        lines.append(f"PLAIN: {_TEXT}")
    if trigger.special_id is not None:
        alternatives = ["PLAIN", f"PLAIN {trig} {calls}"]
    else:
        alternatives = ["PLAIN", f"lead {calls}"]
        lines.append(f"lead[lazy]: /(?s:.*){regex_escape(trigger.text)}/")
    if bare_rule is not None:
        alternatives.append(f"json_lead {bare_rule} ORTSERVE_REST?")
        lines += [f"json_lead[lazy]: /(?s:.*){JSON_CALL_TRIGGER}/", r"ORTSERVE_REST: /(?s:.+)/"]
    return [f"start: {' | '.join(alternatives)}", *lines]


def bare_call_rules(tools: Sequence[dict[str, Any]], rule: str = "bare") -> list[str]:
    """Rules for the rest of ``{"name": "<tool>", "arguments": {...}}`` after its ``{"name"`` (the trigger):
    the name one of ``tools``, the arguments (or ``parameters``) valid against its schema."""
    lines = [f"{rule}: ORTSERVE_WS? \":\" ORTSERVE_WS? ({' | '.join(f'{rule}{i}' for i in range(len(tools)))}) "
             f"ORTSERVE_WS? \"}}\"",
             r'ORTSERVE_ARGKEY: "\"arguments\"" | "\"parameters\""',
             r"ORTSERVE_WS: /[ \t\r\n]{1,8}/"]
    for index, tool in enumerate(tools):
        name = json.dumps(json.dumps(function_of(tool)["name"]))
        lines.append(f'{rule}{index}: {name} ORTSERVE_WS? "," ORTSERVE_WS? ORTSERVE_ARGKEY ORTSERVE_WS? ":" '
                     f"ORTSERVE_WS? {rule}{index}_args")
        lines.append(f"{rule}{index}_args: {json_rule(parameters_of(tool))}")
    return lines


def per_tool_rules(rule: str, tools: Sequence[dict[str, Any]], body: Any) -> list[str]:
    """``rule: rule0 | rule1 | ...``, one alternative per tool, each ``ruleN: body(tool)`` (after them)."""
    lines = [f"{rule}{index}: {body(tool)}" for index, tool in enumerate(tools)]
    return lines + [f"{rule}: " + " | ".join(f"{rule}{index}" for index in range(len(tools)))]


def regex_escape(text: str) -> str:
    """``text`` as a Rust-regex literal inside Lark's ``/.../`` (slashes escaped too)."""
    out = []
    for ch in text:
        if ch in r"\.+*?()|[]{}^$#&-~/":
            out.append("\\" + ch)
        elif ch == "\n":
            out.append(r"\n")
        else:
            out.append(ch)
    return "".join(out)


def with_thinking(spec: str, open_tag: Trigger, close_tag: Trigger, *, starts_open: bool) -> str:
    """``spec`` (a grammar whose ``start`` is the whole answer) after a thinking block: ``<think>...</think>``
    first, optional when the model opens it itself, the rest of it required when the prompt already opened it.

    NOTE(reasoning): without this a forced call or a JSON answer would leave a thinking model no room to think,
    and where the prompt opened the block, the call would be written inside it (and read as thinking).
    """
    if not spec.startswith("start:"):
        return spec
    answer = "ortserve_answer:" + spec[len("start:"):]
    if close_tag.special_id is not None:  # special tokens never match text: the thought runs until the token
        lines = [f"ortserve_think: ORTSERVE_THOUGHT {close_tag.lark()}", f"ORTSERVE_THOUGHT: {_TEXT}"]
    else:
        lines = [f"ortserve_think[lazy]: /(?s:.*){regex_escape(close_tag.text)}/"]
    lines.append(r"ORTSERVE_WS: /[ \t\r\n]+/")
    if starts_open:
        head = "start: ortserve_think ORTSERVE_WS? ortserve_answer"
    else:
        head = f"start: ({open_tag.lark()} ortserve_think ORTSERVE_WS?)? ortserve_answer"
    return "\n".join([head, *lines]) + "\n" + answer
