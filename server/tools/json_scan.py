"""Reading JSON that may still be growing: object members with their raw spans, partial strings.

The tool-call parsers re-read the whole output at every step; these helpers tell a value that is complete
from one that is still being written, with the C decoder (json.JSONDecoder.raw_decode) doing the scanning.
Pure functions of strings; no engine or server imports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int, final: bool) -> int | None:
    """End index of the complete JSON value starting at ``text[i]``, or None while it is incomplete.

    A number that reaches the end of a growing text may still get more digits, so it counts as complete
    only when ``final``. An invalid value is reported as incomplete (None): the caller decides at the end.
    """
    try:
        _, end = _DECODER.raw_decode(text, i)
    except (json.JSONDecodeError, RecursionError):
        return None
    if end == len(text) and not final and text[i] not in "{[\"":
        return None  # a number or literal at the very end may still grow ("1" -> "12", "nul" -> "null")
    return end


@dataclass(frozen=True)
class Member:
    """One ``"key": value`` of an object being read; ``end`` is None while the value is incomplete."""

    key: str
    start: int  # index of the value's first character (len(text) when none has arrived yet)
    end: int | None

    def raw(self, text: str) -> str:
        """The value's text as written so far (the whole value once complete)."""
        return text[self.start:self.end] if self.end is not None else text[self.start:]

    def decoded(self, text: str) -> object:
        """The complete value, decoded (only call when ``end`` is set)."""
        return json.loads(text[self.start:self.end])


@dataclass(frozen=True)
class ObjectScan:
    """What is known of an object: its members in order, where it closed, whether it went wrong."""

    members: tuple[Member, ...]
    end: int | None  # index just past the closing brace; None while open
    invalid: bool = False  # the text cannot continue into a JSON object

    def get(self, key: str) -> Member | None:
        for member in self.members:
            if member.key == key:
                return member
        return None


def scan_object(text: str, i: int, final: bool = False) -> ObjectScan:
    """Read the object that starts at ``text[i]`` (which must be ``{``) as far as the text goes.

    Args:
        text: the whole output so far.
        i: index of the opening brace.
        final: the text will not grow any more.
    Returns:
        The members read so far (the last one possibly incomplete) and where the object ends, if it does.
    """
    members: list[Member] = []
    if i >= len(text) or text[i] != "{":
        return ObjectScan((), None, invalid=True)
    pos = skip_ws(text, i + 1)
    if pos < len(text) and text[pos] == "}":
        return ObjectScan((), pos + 1)
    while True:
        if pos >= len(text):
            return ObjectScan(tuple(members), None)
        if text[pos] != '"':
            return ObjectScan(tuple(members), None, invalid=True)
        key_end = value_end(text, pos, final=True)
        if key_end is None:
            return ObjectScan(tuple(members), None)  # the key is still being written
        key = json.loads(text[pos:key_end])
        pos = skip_ws(text, key_end)
        if pos >= len(text):
            return ObjectScan(tuple(members), None)
        if text[pos] != ":":
            return ObjectScan(tuple(members), None, invalid=True)
        start = skip_ws(text, pos + 1)
        end = value_end(text, start, final) if start < len(text) else None
        members.append(Member(key, start, end))
        if end is None:
            return ObjectScan(tuple(members), None)
        pos = skip_ws(text, end)
        if pos >= len(text):
            return ObjectScan(tuple(members), None)
        if text[pos] == "}":
            return ObjectScan(tuple(members), pos + 1)
        if text[pos] != ",":
            return ObjectScan(tuple(members), None, invalid=True)
        pos = skip_ws(text, pos + 1)


def scan_array_items(text: str, i: int) -> tuple[list[int], int | None, bool]:
    """Start indices of the items of the array at ``text[i]`` (which must be ``[``), read as far as possible.

    Returns:
        (item starts, index just past the closing bracket or None while open, invalid). Items are objects
        for every caller here; an item that is still open is the last start in the list.
    """
    starts: list[int] = []
    if i >= len(text) or text[i] != "[":
        return starts, None, True
    pos = skip_ws(text, i + 1)
    if pos < len(text) and text[pos] == "]":
        return starts, pos + 1, False
    while pos < len(text):
        starts.append(pos)
        end = value_end(text, pos, final=False)
        if end is None:
            return starts, None, False
        pos = skip_ws(text, end)
        if pos >= len(text):
            return starts, None, False
        if text[pos] == "]":
            return starts, pos + 1, False
        if text[pos] != ",":
            return starts, None, True
        pos = skip_ws(text, pos + 1)
    return starts, None, False


def partial_string(raw: str) -> str | None:
    """Decode the JSON string ``raw`` that may lack its end: what is certain of its content so far.

    ``'"Hel'`` gives ``'Hel'``; a trailing incomplete escape (``'"a\\\\u00'``) or a lone high surrogate is
    held back. Returns None when ``raw`` does not start a string.
    """
    if not raw.startswith('"'):
        return None
    end = value_end(raw, 0, final=True)
    if end is not None:
        return json.loads(raw[:end])
    body = raw[1:]
    # Drop an unfinished escape at the end: a lone backslash, or \\u with fewer than 4 hex digits.
    cut = body.rfind("\\")
    if cut >= 0:
        run = len(body[:cut + 1]) - len(body[:cut + 1].rstrip("\\"))  # backslashes ending at `cut`
        if run % 2 == 1:  # body[cut] starts an escape
            tail = body[cut + 1:]
            if not tail or (tail[0] == "u" and len(tail) < 5):
                body = body[:cut]
    for trim in (0, 6):  # a \\uD800-\\uDBFF high surrogate waits for its low half
        candidate = body[:len(body) - trim] if trim else body
        try:
            text = json.loads('"' + candidate + '"')
        except json.JSONDecodeError:
            continue
        if text and "\ud800" <= text[-1] <= "\udbff":
            continue
        return text
    return ""
