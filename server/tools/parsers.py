"""Tool-call output formats: one small parser per model family, and a registry of them.

Every parser reads the whole output so far and says what it holds: the content (text for the user) and the
calls (name + arguments as written). The streaming layer (server.tools.stream) re-parses at every step and
sends the difference, so each parser keeps one promise: a partial parse never shows content or arguments
that a later parse would take back (a tag still being written stays hidden). Pure functions of strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from server.tools.json_scan import ObjectScan, partial_string, scan_array_items, scan_object, skip_ws, value_end


@dataclass(frozen=True)
class ParsedCall:
    """One tool call as read so far: ``arguments`` is JSON text (complete once ``complete``)."""

    name: str
    arguments: str
    complete: bool


@dataclass(frozen=True)
class ParsedMessage:
    """The content and the calls that a text holds."""

    content: str
    calls: tuple[ParsedCall, ...] = ()


def hold_back(text: str, *markers: str) -> str:
    """``text`` without a tail that could still grow into one of ``markers`` (``"Hi <tool"`` -> ``"Hi "``)."""
    keep = len(text)
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                keep = min(keep, len(text) - size)
                break
    return text[:keep]


def call_from_object(text: str, start: int, final: bool,
                     argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[ParsedCall | None, ObjectScan]:
    """A call read from ``{"name": ..., "arguments": {...}}`` at ``text[start]``: None until the name is whole.

    The arguments are the raw text of the value as the model wrote it (whole once the value closes), so
    what was streamed is always a prefix of the final arguments. A string value (arguments JSON-encoded
    as a string, as some models write them) is decoded.
    """
    scan = scan_object(text, start, final)
    name_member = scan.get("name")
    if name_member is None:
        return None, scan
    if name_member.end is None:
        # NOTE(tools): at the end (max_tokens cut the name) the call is kept with the name written so far and
        # no arguments; ToolCallStream completes the name from the tools when the prefix names one of them.
        partial = partial_string(name_member.raw(text)) if final else None
        return (ParsedCall(partial, "", False) if partial else None), scan
    name = name_member.decoded(text)
    if not isinstance(name, str) or not name:
        return None, scan
    args_member = next((m for k in argument_keys if (m := scan.get(k)) is not None), None)
    complete = scan.end is not None
    if args_member is None:
        arguments = "{}" if complete else ""
    elif text.startswith('"', args_member.start):
        arguments = partial_string(args_member.raw(text)) or ""
    else:
        arguments = args_member.raw(text)
        if args_member.end is None:
            arguments = arguments.rstrip()  # a trailing space may be followed by the closing brace
    return ParsedCall(name, arguments, complete), scan


class ToolParser:
    """One model family's tool-call format.

    Usage::

        parser = make_parser("hermes")
        parser.parse('<tool_call>\\n{"name": "f", "arguments": {}}\\n</tool_call>', final=True)
        # ParsedMessage(content='', calls=(ParsedCall(name='f', arguments='{}', complete=True),))

    Attributes:
        name: the registry key.
        preserved_tokens: special tokens the format is written with; the detokenizer must keep them.
    """

    name: ClassVar[str] = ""
    preserved_tokens: ClassVar[tuple[str, ...]] = ()

    def parse(self, text: str, final: bool) -> ParsedMessage:
        """What ``text`` holds.

        Args:
            text: the whole output so far.
            final: no more text will come (the request finished); undecided markup becomes content.
        """
        raise NotImplementedError


def _content(text: str, final: bool, *markers: str) -> str:
    """Plain text before any call: everything when final, else without a possible marker start or
    trailing whitespace (which a call that follows would drop)."""
    return text if final else hold_back(text, *markers).rstrip()


class HermesParser(ToolParser):
    """Hermes / Qwen 2.5+: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, possibly several."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    preserved_tokens = (OPEN, CLOSE)  # some models have them as special tokens

    def parse(self, text: str, final: bool) -> ParsedMessage:
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


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}`` as the whole answer, optionally
    after ``<|python_tag|>``; several are separated by ``;``. Any other answer is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    preserved_tokens = (TAG,)

    def parse(self, text: str, final: bool) -> ParsedMessage:
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


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers), or
    ``[TOOL_CALLS]name[ARGS]{...}`` repeated (v11+, with an optional ``[CALL_ID]id``)."""

    name = "mistral"
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    preserved_tokens = (TAG, ARGS, CALL_ID)

    def parse(self, text: str, final: bool) -> ParsedMessage:
        first = text.find(self.TAG)
        if first < 0:
            return ParsedMessage(_content(text, final, self.TAG))
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


class GenericParser(ToolParser):
    """ortserve's format for models without native tool calls (the answer is one JSON object, enforced by
    a grammar): ``{"tool_calls": [{"name", "arguments"}, ...]}``, ``{"tool_call": {...}}`` or
    ``{"response": "text"}``, as llama.cpp's generic handler."""

    name = "generic"

    def parse(self, text: str, final: bool) -> ParsedMessage:
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


PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, GenericParser)
}


def make_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (KeyError names the known ones)."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown tool-call format {name!r}; known: {sorted(PARSERS)}") from None


def dumps_arguments(arguments: object) -> str:
    """Arguments given as an object (templates, history) as the JSON text the wire carries."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
