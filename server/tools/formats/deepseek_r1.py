"""DeepSeek R1's tool calls, written with its own tokens::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from server.tools.formats.base import ToolFormat, content_before_calls
from server.tools.formats.calls import ParsedCall, ParsedMessage
from server.tools.grammar import Trigger, function_of, json_rule, parameters_of, per_tool_rules, tagged_start
from server.tools.json_scan import skip_ws, value_end


class DeepSeekR1Format(ToolFormat):
    """DeepSeek R1 (and V3): calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``."""

    name = "deepseek_r1"
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    preserved_tokens = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    template_markers = (CALLS_BEGIN,)

    def parse_native(self, text: str, final: bool) -> ParsedMessage:
        first = text.find(self.CALLS_BEGIN)
        if first < 0:
            return ParsedMessage(content_before_calls(text, final, self.CALLS_BEGIN))
        content, calls, pos = text[:first].rstrip(), [], first
        while (begin := text.find(self.CALL_BEGIN, pos)) >= 0:
            sep = text.find(self.SEP, begin)
            newline = text.find("\n", sep) if sep >= 0 else -1
            if newline < 0:
                break  # the name is still being written
            name = text[sep + len(self.SEP):newline].strip()
            start = text.find("```json", newline)
            start = skip_ws(text, start + len("```json")) if start >= 0 else -1
            if start < 0 or start >= len(text):
                calls.append(ParsedCall(name, "", False))
                break
            end = text.find(self.CALL_END, start)
            segment = text[:end] if end >= 0 else text
            stop = value_end(segment, start, final or end >= 0)
            arguments = segment[start:stop] if stop is not None else segment[start:].rstrip().removesuffix("```")
            calls.append(ParsedCall(name, arguments.rstrip(), stop is not None))
            if end < 0:
                break
            pos = end + len(self.CALL_END)
        return ParsedMessage(content, tuple(calls))

    def grammar(self, tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                trigger: Callable[[str], Trigger], template_source: str = "",
                response: dict[str, Any] | None = None) -> str:
        begin, end = trigger(self.CALL_BEGIN).lark(), trigger(self.CALL_END).lark()
        sep = trigger(self.SEP).lark()
        lines = tagged_start(trigger(self.CALLS_BEGIN), "calls", required=required, repeat=False, separator="",
                             response=response)
        repeat = "*" if parallel else ""
        lines.append(f"calls: one (one){repeat} {trigger(self.CALLS_END).lark()}" if parallel
                     else f"calls: one {trigger(self.CALLS_END).lark()}")
        lines += per_tool_rules("one", tools, lambda tool: f'{begin} "function" {sep} '
                                f'{json.dumps(function_of(tool)["name"])} '
                                f'"\\n```json\\n" {json_rule(parameters_of(tool))} "\\n```" {end}')
        return "\n".join(lines) + "\n"
