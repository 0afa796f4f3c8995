"""Hermes / Qwen 2.5+ tool calls: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.tools.formats.base import ToolFormat
from server.tools.formats.calls import ParsedMessage, call_from_object, hold_back
from server.tools.grammar import Trigger, bare_call_rules, call_schema, json_rule, tagged_start
from server.tools.json_scan import skip_ws


class HermesFormat(ToolFormat):
    """Hermes / Qwen 2.5+: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, possibly several."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    preserved_tokens = (OPEN, CLOSE)  # some models have them as special tokens
    template_markers = ("<tool_call>",)

    def parse_native(self, text: str, final: bool) -> ParsedMessage:
        content, calls, pos = "", [], 0
        while True:
            opened = text.find(self.OPEN, pos)
            segment = text[pos:] if opened < 0 else text[pos:opened]
            if calls:
                segment = segment.lstrip()  # the newlines between and after calls are not content
            if opened < 0:
                content += segment if final else hold_back(segment, self.OPEN).rstrip()
                return ParsedMessage(content, tuple(calls))
            content += segment
            body = skip_ws(text, opened + len(self.OPEN))
            close = text.find(self.CLOSE, body)
            block = text if close < 0 else text[:close]  # the JSON must end inside the block
            call, scan = call_from_object(block, body, final or close >= 0) if body < len(block) else (None, None)
            if close < 0:  # the last block is still open (or was cut by max_tokens when final)
                if call is not None:
                    calls.append(call)
                elif final:
                    content += text[opened:]
                return ParsedMessage(content.rstrip() if calls or not final else content, tuple(calls))
            if call is not None and scan is not None and scan.end is not None:
                calls.append(call)
                content = content.rstrip()  # the space before a call was never sent
            else:  # a closed block that is not a call: the model wrote the tags as text
                content += text[opened:close + len(self.CLOSE)]
            pos = close + len(self.CLOSE)

    def grammar(self, tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                trigger: Callable[[str], Trigger], template_source: str = "",
                response: dict[str, Any] | None = None) -> str:
        return hermes_grammar(tools, trigger=trigger(self.OPEN), close=trigger(self.CLOSE), required=required,
                              parallel=parallel, response=response)


def hermes_grammar(tools: Sequence[dict[str, Any]], *, trigger: Trigger, close: Trigger, required: bool,
                   parallel: bool, response: dict[str, Any] | None = None) -> str:
    """Hermes / Qwen: ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``, calls separated by a newline."""
    bare = not required and response is None  # auto: a fenced or bare JSON call is enforced too (issue 34)
    lines = tagged_start(trigger, "call", required=required, repeat=parallel, separator="\n", response=response,
                         bare_rule="bare" if bare else None)
    lines += [f'call: "\\n" body "\\n" {close.lark()}', f"body: {json_rule(call_schema(tools))}"]
    if bare:
        lines += bare_call_rules(tools)
    return "\n".join(lines) + "\n"
