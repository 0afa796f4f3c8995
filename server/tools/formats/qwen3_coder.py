"""Qwen3-Coder's XML tool calls: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
</function>\\n</tool_call>``, as llama.cpp's Qwen3-Coder XML handler reads them.

A value is JSON when it reads as JSON (a number, true, an object, ...), else the text itself; the arguments
are streamed one whole parameter at a time, so what was sent is always a prefix of the final JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from server.tools.formats.base import ToolFormat
from server.tools.formats.calls import ParsedCall, ParsedMessage, hold_back
from server.tools.grammar import Trigger, function_of, parameters_of, regex_escape, tagged_start

_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return raw


class Qwen3CoderFormat(ToolFormat):
    """Qwen3-Coder: one ``<function=...>`` with ``<parameter=...>`` blocks per ``<tool_call>``."""

    name = "qwen3_coder"
    OPEN, CLOSE, FUNCTION_END = "<tool_call>", "</tool_call>", "</function>"
    preserved_tokens = (OPEN, CLOSE)
    template_markers = ("<function=", "<parameter=")

    def parse_native(self, text: str, final: bool) -> ParsedMessage:
        calls: list[ParsedCall] = []
        content, pos = "", 0
        while True:
            opened = text.find(self.OPEN, pos)
            segment = text[pos:] if opened < 0 else text[pos:opened]
            if calls:
                segment = segment.lstrip()
            if opened < 0:
                content += segment if final else hold_back(segment, self.OPEN).rstrip()
                return ParsedMessage(content, tuple(calls))
            content = (content + segment).rstrip()
            close = text.find(self.CLOSE, opened)
            block = text[opened + len(self.OPEN):close if close >= 0 else len(text)]
            call = self._call(block, final or close >= 0)
            if call is None:
                if close < 0:
                    return ParsedMessage(content if not final else content + text[opened:], tuple(calls))
                content += text[opened:close + len(self.CLOSE)]
            else:
                calls.append(call)
            if close < 0:
                return ParsedMessage(content, tuple(calls))
            pos = close + len(self.CLOSE)

    def _call(self, block: str, closed: bool) -> ParsedCall | None:
        function = _FUNCTION.search(block)
        if function is None or not function.group(1).strip():
            return None
        body = block[function.end():]
        members = [f"{json.dumps(m.group(1).strip())}: {json.dumps(_value(m.group(2)), ensure_ascii=False)}"
                   for m in _PARAMETER.finditer(body)]
        complete = self.FUNCTION_END in body or closed
        arguments = "{" + ", ".join(members) + ("}" if complete else "")
        return ParsedCall(function.group(1).strip(), arguments, complete)

    def grammar(self, tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                trigger: Callable[[str], Trigger], template_source: str = "",
                response: dict[str, Any] | None = None) -> str:
        lines = tagged_start(trigger(self.OPEN), "call", required=required, repeat=parallel, separator="\n",
                             response=response)
        names = []
        for index, tool in enumerate(tools):
            params = list((parameters_of(tool).get("properties") or {}))
            names.append(f"fn{index}")
            keys = " | ".join(json.dumps(f"<parameter={key}>\n") for key in params) or '"<parameter="'
            lines.append(f'fn{index}: {json.dumps("<function=" + function_of(tool)["name"] + ">" + chr(10))} '
                         f'(fn{index}_param)* "</function>\\n"')
            lines.append(f"fn{index}_param: ({keys}) qwen3_value")
        lines.append(f'call: "\\n" ({" | ".join(names)}) {trigger(self.CLOSE).lark()}')
        lines.append(f"qwen3_value[lazy]: /(?s:.*){regex_escape(chr(10) + '</parameter>' + chr(10))}/")
        return "\n".join(lines) + "\n"
