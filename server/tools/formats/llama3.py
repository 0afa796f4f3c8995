"""Llama 3.1-3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.tools.formats.base import ToolFormat
from server.tools.formats.calls import ParsedCall, ParsedMessage, call_from_object
from server.tools.grammar import Trigger, call_schema, json_rule
from server.tools.json_scan import scan_object, skip_ws


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1-3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}`` as the whole answer, optionally
    after ``<|python_tag|>``; several are separated by ``;``. Any other answer is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    preserved_tokens = (TAG,)
    template_markers = ("<|python_tag|>", "<|start_header_id|>ipython<|end_header_id|>")

    @classmethod
    def matches_template(cls, source: str) -> bool:
        return any(marker in source for marker in cls.template_markers)  # 3.2 has the ipython role, no tag

    def parse_native(self, text: str, final: bool) -> ParsedMessage:
        start = skip_ws(text, 0)
        if text.startswith(self.TAG, start):
            start = skip_ws(text, start + len(self.TAG))
        elif not final and self.TAG.startswith(text[start:]) and start < len(text):
            return ParsedMessage("")  # maybe the tag is being written
        if start >= len(text):  # nothing but whitespace (and the tag) so far
            return ParsedMessage(text if final and self.TAG not in text else "")
        if text[start] != "{":
            return ParsedMessage(text if final else text.rstrip())
        calls: list[ParsedCall] = []
        pos = start
        while True:
            scan = scan_object(text, pos, final)
            first_key = scan.members[0].key if scan.members else None
            if first_key is None or first_key not in ("name", "type"):
                if calls or first_key is not None or scan.invalid or final:
                    break  # a JSON answer that is not a call: content (decided below)
                return ParsedMessage("", ())  # undecided: the first key is still being written
            call, scan = call_from_object(text, pos, final)
            if call is None:
                if final or scan.invalid:
                    break
                return ParsedMessage("", tuple(calls))
            calls.append(call)
            if scan.end is None:
                return ParsedMessage("", tuple(calls))
            pos = skip_ws(text, scan.end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_ws(text, pos + 1)
            if pos >= len(text) or text[pos] != "{":
                break
        if not calls:
            return ParsedMessage(text if final else "")
        return ParsedMessage(text[pos:].strip() if pos < len(text) and final else "", tuple(calls))

    def grammar(self, tools: Sequence[dict[str, Any]], *, required: bool, parallel: bool,
                trigger: Callable[[str], Trigger], template_source: str = "",
                response: dict[str, Any] | None = None) -> str:
        return llama3_grammar(tools, required=required, python_tag=trigger(self.TAG))


def llama3_grammar(tools: Sequence[dict[str, Any]], *, required: bool, python_tag: Trigger | None) -> str:
    """Llama 3.x: the answer is one ``{"name", "parameters"}`` object (after ``<|python_tag|>`` if the model
    writes one); in ``auto`` an answer that does not start with ``{`` is text."""
    lines = [f"call: {json_rule(call_schema(tools, 'parameters'))}"]
    tagged = f" | {python_tag.lark()} call" if python_tag is not None and python_tag.special_id is not None else ""
    if required:
        lines.insert(0, f"start: call{tagged}")
    else:
        lines.insert(0, f"start: TEXT | call{tagged}")
        lines.append(r"TEXT: /([^{](?s:.*))?/")
    return "\n".join(lines) + "\n"
