"""Mistral tool calls: ``[TOOL_CALLS][{...}, ...]`` (v3 tokenizers) or ``[TOOL_CALLS]name[ARGS]{...}`` (v11+)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from server.tools.formats.base import ToolFormat, content_before_calls
from server.tools.formats.calls import ParsedCall, ParsedMessage, call_from_object
from server.tools.grammar import (Trigger, call_schema, function_of, hoist_defs, json_rule, parameters_of,
                                  per_tool_rules, tagged_start)
from server.tools.json_scan import scan_array_items, skip_ws, value_end


class MistralFormat(ToolFormat):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers), or
    ``[TOOL_CALLS]name[ARGS]{...}`` repeated (v11+, with an optional ``[CALL_ID]id``)."""

    name = "mistral"
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    preserved_tokens = (TAG, ARGS, CALL_ID)
    template_markers = ("[TOOL_CALLS]",)

    def parse_native(self, text: str, final: bool) -> ParsedMessage:
        first = text.find(self.TAG)
        if first < 0:
            return ParsedMessage(content_before_calls(text, final, self.TAG))
        content = text[:first].rstrip()
        body = skip_ws(text, first + len(self.TAG))
        if body >= len(text):
            return ParsedMessage(content)
        if text[body] == "[":
            return ParsedMessage(content, self._json_array(text, body, final))
        return ParsedMessage(content, self._named(text, first, final))

    @staticmethod
    def _json_array(text: str, start: int, final: bool) -> tuple[ParsedCall, ...]:
        calls = []
        starts, _, _ = scan_array_items(text, start)
        for item in starts:
            call, _ = call_from_object(text, item, final)
            if call is None:
                break
            calls.append(call)
        return tuple(calls)

    def _named(self, text: str, pos: int, final: bool) -> tuple[ParsedCall, ...]:
        calls = []
        while pos >= 0:
            head = pos + len(self.TAG)
            args_at = text.find(self.ARGS, head)
            if args_at < 0:
                break  # the name is still being written
            name = text[head:args_at].split(self.CALL_ID)[0].strip()
            start = skip_ws(text, args_at + len(self.ARGS))
            nxt = text.find(self.TAG, start)
            segment = text[:nxt] if nxt >= 0 else text
            end = value_end(segment, start, final or nxt >= 0) if start < len(segment) else None
            arguments = segment[start:end] if end is not None else segment[start:].rstrip()
            calls.append(ParsedCall(name, arguments, end is not None))
            pos = nxt
        return tuple(calls)

    def grammar(self, tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                trigger: Callable[[str], Trigger], template_source: str = "",
                response: dict[str, Any] | None = None) -> str:
        args = trigger(self.ARGS) if self.ARGS in template_source else None
        return mistral_grammar(tools, trigger=trigger(self.TAG), required=required, parallel=parallel,
                               args_token=args if args is not None and args.special_id is not None else None,
                               response=response)


def mistral_grammar(tools: Sequence[dict[str, Any]], *, trigger: Trigger, args_token: Trigger | None,
                    required: bool, parallel: bool, response: dict[str, Any] | None = None) -> str:
    """Mistral: ``[TOOL_CALLS][{"name", "arguments"}, ...]`` (v3 tokenizers), or ``[TOOL_CALLS]name[ARGS]{...}``
    per call when the tokenizer has ``[ARGS]`` (v11+)."""
    if args_token is None:
        call, defs = hoist_defs(call_schema(tools))
        array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        if defs:
            array["$defs"] = defs
        lines = tagged_start(trigger, "calls", required=required, repeat=False, separator="", response=response)
        return "\n".join(lines + [f"calls: {json_rule(array)}"]) + "\n"
    lines = tagged_start(trigger, "call", required=required, repeat=parallel, separator="", response=response)
    # The parameters schema is a document of its own here, so its local refs resolve as written.
    lines += per_tool_rules("call", tools, lambda tool: f"{json.dumps(function_of(tool)['name'])} "
                                                          f"{args_token.lark()} {json_rule(parameters_of(tool))}")
    return "\n".join(lines) + "\n"
