"""Tool calls written without the format's markers: what real models write under tool_choice "auto".

Qwen2.5-Coder, asked through its Hermes template, writes ````` ```json {"name": "get_weather", "arguments": {...}} ``` `````
or the bare object about as often as ``<tool_call>`` (issue 34). Accepted here, as llama.cpp's chat parsers do:
a fenced ``json`` / ``xml`` / ``tool_call`` (or unlabelled) block, or a bare JSON object or array, whose object
has ``name`` (an offered tool) and ``arguments`` or ``parameters``; ``<tool_call>`` blocks (Hermes's tags, which
models of other families write too), fenced or not. Anything else stays content; text that merely names a tool is content.

The promise of every format holds: while a candidate (a ``{``, ``[`` or fence) could still become a call, it
and everything after it are held back; once it is decided it never changes (a call is decided when its
name is whole and names a tool and its arguments have started; text when it can no longer be a call).
Pure functions of strings.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from server.tools.formats.calls import ParsedCall, ParsedMessage, call_from_object
from server.tools.json_scan import partial_string, scan_array_items, scan_object, skip_ws

FENCE = "```"
FENCE_LANGS = ("", "json", "xml", "tool_call", "tool_calls")
_ARG_KEYS = ("arguments", "parameters")
_CALL_KEYS = ("name", *_ARG_KEYS, "type", "id")
_XML_OPEN, _XML_CLOSE = "<tool_call>", "</tool_call>"
# Where a candidate may start: a fence, an object, an array; and a fence still being written at the end.
_CANDIDATE = re.compile(r"```|\{|\[|<|``?$")


@dataclass(frozen=True)
class _Decision:
    """What a candidate turned out to be: ``calls`` (then ``end`` is where they end, None while they go on),
    text (no calls; ``end`` is where to look next), or undecided (``undecided``)."""

    calls: tuple[ParsedCall, ...] = ()
    end: int | None = None
    undecided: bool = False


_UNDECIDED = _Decision(undecided=True)


def parse_loose(text: str, final: bool, tool_names: Collection[str]) -> ParsedMessage:
    """The content and the calls in ``text`` written without markers (see the module docstring).

    Args:
        text: the whole output so far.
        final: no more text will come: an undecided candidate is content.
        tool_names: the names a call may have; with none, nothing is a call.
    """
    if not tool_names:
        return ParsedMessage(text if final else text.rstrip())
    content, calls, pos, search = "", [], 0, 0
    while True:
        match = _CANDIDATE.search(text, search)
        if match is None:
            segment = text[pos:]
            if calls:
                segment = segment.lstrip()
            return ParsedMessage(content + (segment if final else segment.rstrip()), tuple(calls))
        start = match.start()
        decision = _decide(text, start, final, tool_names)
        if decision.undecided:
            segment = text[pos:start]
            return ParsedMessage(content + (segment.lstrip() if calls else segment).rstrip(), tuple(calls))
        if not decision.calls:
            search = decision.end if decision.end is not None and decision.end > start else start + 1
            continue
        segment = text[pos:start]
        content += (segment.lstrip() if calls else segment).rstrip()
        calls += decision.calls
        if decision.end is None:  # the calls go on to the end of the text so far
            return ParsedMessage(content, tuple(calls))
        pos = search = decision.end


def _decide(text: str, start: int, final: bool, names: Collection[str]) -> _Decision:
    if text.startswith(FENCE, start):
        return _fenced(text, start, final, names)
    if text[start] == "`":  # "`" or "``" at the very end: maybe a fence
        return _Decision() if final else _UNDECIDED
    if text[start] == "<":
        if text.startswith(_XML_OPEN, start):
            return _xml_blocks(text, start, final, names)
        if not final and _XML_OPEN.startswith(text[start:]):
            return _UNDECIDED
        return _Decision(end=start + 1)
    return _bare(text, start, final, names)


def _bare(text: str, start: int, final: bool, names: Collection[str]) -> _Decision:
    """A JSON object or array of calls at ``text[start]``."""
    if text[start] == "{" and (inner := skip_ws(text, start + 1)) < len(text) and text[inner] == "{":
        return _wrapped(text, start, inner, final, names)
    if text[start] == "{":
        call, end, state = _object_call(text, start, final, names)
        if state == "call":
            return _Decision((call,), end)
        return _UNDECIDED if state == "undecided" else _Decision(end=end)
    first = skip_ws(text, start + 1)
    if first >= len(text):
        return _Decision() if final else _UNDECIDED
    if text[first] != "{":
        return _Decision()
    items, array_end, _ = scan_array_items(text, start)
    calls = []
    for item in items:
        call, _, state = _object_call(text, item, final, names)
        if state == "undecided" and not calls:
            return _UNDECIDED
        if state != "call":
            break
        calls.append(call)
    if not calls:
        return _Decision(end=array_end)
    return _Decision(tuple(calls), array_end)


def _wrapped(text: str, start: int, inner: int, final: bool, names: Collection[str]) -> _Decision:
    """A call inside one more pair of braces, ``{{"name": ..., "arguments": {...}}}``: models whose template shows
    its example call with doubled braces (Qwen2.5's Hermes template) write it so, often without the last brace.
    The wrapper is no content: the call ends after the wrapper's ``}`` when one follows, else after the call."""
    decision = _bare(text, inner, final, names)
    if decision.undecided or not decision.calls or decision.end is None:
        return decision if decision.undecided or decision.calls else _Decision(end=start + 1)
    after = skip_ws(text, decision.end)
    if after < len(text) and text[after] == "}":
        return _Decision(decision.calls, after + 1)
    if after >= len(text) and not final:
        return _Decision(decision.calls, None)  # the wrapper's closing brace may be coming: hold it back
    return decision


def _object_call(text: str, start: int, final: bool, names: Collection[str]) -> tuple[ParsedCall | None, int | None,
                                                                                       str]:
    """``(call, end, state)`` for the object at ``text[start]``: state "call", "text" or "undecided"."""
    scan = scan_object(text, start, final)
    if scan.invalid or any(m.key not in _CALL_KEYS for m in scan.members):
        return None, scan.end, "text"
    name = scan.get("name")
    has_args = any(scan.get(k) is not None for k in _ARG_KEYS)
    if name is not None and name.end is not None:
        value = name.decoded(text)
        if not isinstance(value, str) or value not in names:
            return None, scan.end, "text"
        if has_args:
            call, _ = call_from_object(text, start, final)
            return call, scan.end, "call"
    elif name is not None:  # the name is being written: a prefix of a tool's?
        raw = name.raw(text)
        partial = partial_string(raw) if raw else ""
        if partial is None or not any(n.startswith(partial) for n in names):
            return None, scan.end, "text"
    if scan.end is not None or final:
        return None, scan.end, "text"  # closed (or cut) without a named tool and its arguments
    return None, None, "undecided"


def _fenced(text: str, start: int, final: bool, names: Collection[str]) -> _Decision:
    """A fenced block at ``text[start]`` whose body is a call (JSON, or ``<tool_call>`` blocks)."""
    info_start = start + len(FENCE)
    newline = text.find("\n", info_start)
    info = (text[info_start:] if newline < 0 else text[info_start:newline]).strip().lower()
    if newline < 0:
        if final or not any(lang.startswith(info) for lang in FENCE_LANGS if lang):
            return _Decision(end=info_start)
        return _UNDECIDED
    if info not in FENCE_LANGS:
        return _Decision(end=info_start)
    body = skip_ws(text, newline + 1)
    if body >= len(text):
        return _Decision(end=info_start) if final else _UNDECIDED
    if text.startswith(_XML_OPEN, body) or (not final and _XML_OPEN.startswith(text[body:])):
        decision = _xml_blocks(text, body, final, names)
    elif text[body] in "{[":
        decision = _bare(text, body, final, names)
    else:
        return _Decision(end=info_start)
    if decision.undecided or not decision.calls:
        return decision if decision.undecided else _Decision(end=info_start)
    if decision.end is None:
        return decision
    after = skip_ws(text, decision.end)
    if text.startswith(FENCE, after):
        return _Decision(decision.calls, after + len(FENCE))
    if not final and FENCE.startswith(text[after:]):
        return _Decision(decision.calls, None)  # the closing fence may be coming: hold it back
    return decision


def _xml_blocks(text: str, start: int, final: bool, names: Collection[str]) -> _Decision:
    """``<tool_call>{...}</tool_call>`` blocks (separated by whitespace) at ``text[start]``."""
    calls: list[ParsedCall] = []
    pos = start
    while text.startswith(_XML_OPEN, pos):
        body = skip_ws(text, pos + len(_XML_OPEN))
        if body >= len(text):
            break
        if text[body] != "{":
            return _Decision(tuple(calls), pos) if calls else _Decision(end=start + 1)
        call, end, state = _object_call(text, body, final, names)
        if state == "undecided":
            return _Decision(tuple(calls), None) if calls else _UNDECIDED
        if state != "call":
            return _Decision(tuple(calls), pos) if calls else _Decision(end=start + 1)
        calls.append(call)
        if end is None:
            return _Decision(tuple(calls), None)
        close = skip_ws(text, end)
        if text.startswith(_XML_CLOSE, close):
            pos = skip_ws(text, close + len(_XML_CLOSE))
        elif not final and _XML_CLOSE.startswith(text[close:]):
            return _Decision(tuple(calls), None)
        else:
            return _Decision(tuple(calls), close)
    if not calls:
        return _Decision() if final else _UNDECIDED
    if not final and pos >= len(text) - len(_XML_OPEN) and _XML_OPEN.startswith(text[pos:]) and pos < len(text):
        return _Decision(tuple(calls), None)
    return _Decision(tuple(calls), pos)

