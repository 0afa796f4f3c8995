"""Phi-4-mini's tool calls: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.tools.formats.base import ToolFormat, content_before_calls
from server.tools.formats.calls import ParsedCall, ParsedMessage, call_from_object
from server.tools.grammar import Trigger, call_schema, hoist_defs, json_rule, tagged_start
from server.tools.json_scan import scan_array_items, skip_ws


class Phi4MiniFormat(ToolFormat):
    """Phi-4-mini: a JSON list (or one object) of calls between ``<|tool_call|>`` and ``<|/tool_call|>``."""

    name = "phi4_mini"
    OPEN, CLOSE = "<|tool_call|>", "<|/tool_call|>"
    preserved_tokens = (OPEN, CLOSE)
    template_markers = ("<|tool_call|>", "<|tool|>")

    @classmethod
    def matches_template(cls, source: str) -> bool:
        return any(marker in source for marker in cls.template_markers)  # Phi-4-mini's own shows only <|tool|>

    def parse_native(self, text: str, final: bool) -> ParsedMessage:
        first = text.find(self.OPEN)
        if first < 0:
            return ParsedMessage(content_before_calls(text, final, self.OPEN))
        content = text[:first].rstrip()
        body = skip_ws(text, first + len(self.OPEN))
        close = text.find(self.CLOSE, body)
        block = text if close < 0 else text[:close]
        calls: list[ParsedCall] = []
        if body < len(block) and block[body] == "[":
            for item in scan_array_items(block, body)[0]:
                call, _ = call_from_object(block, item, final or close >= 0)
                if call is None:
                    break
                calls.append(call)
        elif body < len(block) and block[body] == "{":
            call, _ = call_from_object(block, body, final or close >= 0)
            calls += [call] if call is not None else []
        after = text[close + len(self.CLOSE):].strip() if close >= 0 else ""
        return ParsedMessage((content + ("\n" if content and after else "") + after) if final else content,
                             tuple(calls))

    def grammar(self, tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                trigger: Callable[[str], Trigger], template_source: str = "",
                response: dict[str, Any] | None = None) -> str:
        call, defs = hoist_defs(call_schema(tools))
        array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        if defs:
            array["$defs"] = defs
        lines = tagged_start(trigger(self.OPEN), "calls", required=required, repeat=False, separator="",
                             response=response)
        return "\n".join(lines + [f"calls: {json_rule(array)} {trigger(self.CLOSE).lark()}"]) + "\n"
