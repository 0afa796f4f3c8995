"""What a tool-call parser reads out of a text: the calls and the content, and the helpers every format's
parser shares (a call from a JSON object, a tail held back while it could grow into a marker). Pure functions of
strings; server.tools.formats.base and .loose both build on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.tools.json_scan import ObjectScan, partial_string, scan_object


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
