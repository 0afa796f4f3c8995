"""Re-parse and diff: a growing model output -> OpenAI message deltas (content, then tool-call fragments).

The same class serves the streamed and the collected answer, so both always agree. Pure; no engine import.
"""

from __future__ import annotations

import logging
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from server.tools.formats.base import ToolFormat
from server.tools.formats.calls import ParsedCall, ParsedMessage

logger = logging.getLogger(__name__)

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A tool-call id as OpenAI writes them: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str  # the part already sent


class ToolCallStream:
    """Feed the output as it grows; get the chat deltas that are safe to send now.

    Usage::

        stream = ToolCallStream(make_format("hermes"))
        for piece in outputs:
            for delta in stream.feed(piece):   # {"content": ...} or {"tool_calls": [...]}
                send(delta)
        stream.feed("", final=True)           # at the end: whatever was held back
        stream.message()                       # {"content", "tool_calls"} as the non-streamed answer

    The first delta of call ``i`` is ``{"index": i, "id", "type": "function", "function": {"name",
    "arguments": ""}}``; later ones carry ``{"index": i, "function": {"arguments": fragment}}``, as OpenAI
    streams them.

    Args:
        parser: the model's format.
        max_calls: keep at most this many calls (1 when parallel_tool_calls is false); None keeps all.
        tool_names: the names a call may have; at the end, a call whose name max_tokens cut is named by the one
            tool its prefix matches (the grammar allows no other), and dropped while the prefix fits several.
    """

    def __init__(self, parser: ToolFormat, max_calls: int | None = None, tool_names: Sequence[str] = ()) -> None:
        self._parser = parser
        self._max_calls = max_calls
        self._tool_names = tuple(tool_names)
        self._text = ""
        self._content = ""  # content already sent
        self._calls: list[_SentCall] = []
        self._parsed = ParsedMessage("")

    @property
    def text(self) -> str:
        """The raw output so far."""
        return self._text

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        """Add ``piece`` to the output; ``final`` once nothing more will come.

        Returns:
            The deltas to send, in order (possibly none).
        """
        self._text += piece
        if not piece and not final:
            return []
        parsed = self._parser.parse(self._text, final)
        calls = parsed.calls if self._max_calls is None else parsed.calls[:self._max_calls]
        if final:
            sent, unsent = calls[:len(self._calls)], calls[len(self._calls):]  # a sent call's name was whole
            calls = (*sent, *(c for call in unsent if (c := self._completed(call)) is not None))
        self._parsed = ParsedMessage(parsed.content, calls)
        if final and calls:
            logger.info("tool calls parsed (%s format): %s", self._parser.name,
                        "; ".join(f"{c.name} {c.arguments}" for c in calls))
            logger.debug("the output they were parsed from: %r", self._text)
        deltas: list[dict[str, Any]] = []
        new_content = self._grown(self._content, parsed.content, "content")
        if new_content:
            deltas.append({"content": new_content})
            self._content = parsed.content
        for index, call in enumerate(calls):
            if index == len(self._calls):
                sent = _SentCall(new_call_id(), call.name, "")
                self._calls.append(sent)
                deltas.append({"tool_calls": [{"index": index, "id": sent.id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            sent = self._calls[index]
            fragment = self._grown(sent.arguments, call.arguments, f"tool call {index} arguments")
            if fragment:
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
                sent.arguments = call.arguments
        return deltas

    def _completed(self, call: ParsedCall) -> ParsedCall | None:
        """A call cut inside its name, named by the only tool whose name starts with what was written; None
        while that prefix could still be several tools (no call is shown under a name that is no tool's)."""
        if call.complete or not self._tool_names or call.name in self._tool_names:
            return call
        matches = [n for n in self._tool_names if n.startswith(call.name)]
        return replace(call, name=matches[0]) if len(matches) == 1 else None

    @staticmethod
    def _grown(sent: str, now: str, what: str) -> str:
        """What ``now`` adds to ``sent``; nothing if a parser broke its promise never to take text back."""
        if now.startswith(sent):
            return now[len(sent):]
        logger.warning("tool-call parser took back %s already sent (%r -> %r); sending nothing more of it",
                       what, sent[-40:], now[-40:])
        return ""

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def message(self) -> dict[str, Any]:
        """The answer as the sent deltas add up: ``{"content": str | None, "tool_calls": [...] | None}``.

        Content is None when the answer holds only calls (as OpenAI answers).
        """
        tool_calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                      for c in self._calls]
        content: str | None = self._content
        if tool_calls and not (content or "").strip():
            content = None
        return {"content": content, "tool_calls": tool_calls or None}
