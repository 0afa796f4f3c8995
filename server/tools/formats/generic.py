"""ortserve's generic tool-call format, for models without native tool calls: the whole answer is one JSON
object (enforced by a grammar), a call or a reply, as llama.cpp's generic handler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.tools.formats.base import ToolFormat
from server.tools.formats.calls import ParsedMessage, call_from_object
from server.tools.grammar import Trigger, call_schema, has_ref, hoist_defs, json_rule, rebase_refs
from server.tools.json_scan import partial_string, scan_array_items, scan_object, skip_ws


class GenericFormat(ToolFormat):
    """ortserve's format for models without native tool calls (the answer is one JSON object, enforced by
    a grammar): ``{"tool_calls": [{"name", "arguments"}, ...]}``, ``{"tool_call": {...}}`` or
    ``{"response": "text"}``, as llama.cpp's generic handler."""

    name = "generic"
    accepts_loose = False  # the grammar makes the whole answer one JSON object of this format

    def parse_native(self, text: str, final: bool) -> ParsedMessage:
        start = skip_ws(text, 0)
        if start >= len(text):
            return ParsedMessage(text if final else "")
        if text[start] != "{":
            return ParsedMessage(text)  # not the enforced format (no grammar): plain text
        scan = scan_object(text, start, final)
        if not scan.members:
            return ParsedMessage(text if final and (scan.invalid or scan.end is not None) else "")
        member = scan.members[0]
        if member.key == "response":
            raw = member.raw(text)
            decoded = partial_string(raw) if raw.startswith('"') else None
            if decoded is None:
                return ParsedMessage(raw if final else "")
            return ParsedMessage(decoded)
        if member.key == "tool_call" and text.startswith("{", member.start):
            call, _ = call_from_object(text, member.start, final)
            return ParsedMessage("", (call,) if call is not None else ())
        if member.key == "tool_calls" and text.startswith("[", member.start):
            calls = []
            for item in scan_array_items(text, member.start)[0]:
                call, _ = call_from_object(text, item, final)
                if call is None:
                    break
                calls.append(call)
            return ParsedMessage("", tuple(calls))
        if member.key in ("tool_call", "tool_calls"):
            return ParsedMessage("")  # a call cut before its name (max_tokens): no text, nothing to name
        return ParsedMessage(text if final else "")  # some other JSON: the user's text, shown at the end

    def grammar(self, tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                trigger: Callable[[str], Trigger], template_source: str = "",
                response: dict[str, Any] | None = None) -> str:
        return generic_grammar(tools, required=required, parallel=parallel, response=response)


def generic_schema(tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                   response: dict[str, Any] | None = None) -> dict[str, Any]:
    """The generic format's answer: ``{"tool_calls": [...]}`` (``{"tool_call": ...}`` when not parallel),
    or, unless ``required``, ``{"response": "..."}``, whose value follows ``response`` (a response_format's
    schema) when given, else is text."""
    call, defs = hoist_defs(call_schema(tools))
    if parallel:
        wrapper = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                   "required": ["tool_calls"], "additionalProperties": False}
    else:
        wrapper = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                   "additionalProperties": False}
    schema: dict[str, Any] = wrapper
    if not required:
        value: dict[str, Any] = {"type": "string"}
        if response is not None:
            value = response
            if has_ref(response):  # its local refs resolve under $defs once embedded
                defs = {**defs, "ortserve_response": rebase_refs(response, "#/$defs/ortserve_response")}
                value = {"$ref": "#/$defs/ortserve_response"}
        answer = {"type": "object", "properties": {"response": value}, "required": ["response"],
                  "additionalProperties": False}
        schema = {"anyOf": [wrapper, answer]}
    return {**schema, "$defs": defs} if defs else schema


def generic_grammar(tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                    response: dict[str, Any] | None = None) -> str:
    return f"start: {json_rule(generic_schema(tools, required=required, parallel=parallel, response=response))}\n"
