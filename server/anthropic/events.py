"""The Messages API's output side: chat-style deltas -> content blocks, the streamed events, and the Message.

One MessageAssembler serves the streamed answer (its events) and the collected one (its message()), so both
always agree. Pure: no I/O, no engine import; wire objects come from server.anthropic.protocol.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from server.anthropic import protocol as wire

Event = dict[str, Any]


@dataclass
class _Block:
    """One content block being built: thinking, text, or a tool_use (its input as JSON text so far)."""

    kind: str  # "thinking" | "text" | "tool_use"
    index: int
    text: str = ""
    id: str = ""
    name: str = ""

    def start(self) -> dict[str, Any]:
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": ""}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": {}}

    def delta(self, text: str) -> dict[str, Any]:
        if self.kind == "thinking":
            return {"type": "thinking_delta", "thinking": text}
        if self.kind == "text":
            return {"type": "text_delta", "text": text}
        return {"type": "input_json_delta", "partial_json": text}

    def wire(self) -> dict[str, Any]:
        if self.kind == "thinking":
            # NOTE(messages): no signature: nothing here is signed, and clients send it back unread.
            return {"type": "thinking", "thinking": self.text, "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": self.text}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": _input(self.text)}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the tool_use ``input`` object ({} when the text is cut short or not an object)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use_id(call_id: str) -> str:
    """``call_...`` (the chat path's ids) -> ``toolu_...``."""
    return "toolu_" + call_id.removeprefix("call_")


@dataclass
class MessageAssembler:
    """The content blocks of one answer, from chat deltas (``{"reasoning_content"}``, ``{"content"}``,
    ``{"tool_calls"}`` as the chat path makes them).

    One block is open at a time; a delta of another kind closes it and opens the next. Every method returns the
    events it caused, as Anthropic streams them.

    Usage::

        asm = MessageAssembler(message_id, model)
        events = asm.start(usage)                 # message_start, ping
        events += asm.feed({"content": "Hi"})     # content_block_start (text), content_block_delta (text_delta)
        events += asm.finish("stop", None, usage) # content_block_stop, message_delta, message_stop
        body = asm.message()                      # the same answer as a Message object

    NOTE(messages): text that is only whitespace waits for non-space text, so a newline before a call leaves no
    empty text block.
    """

    message_id: str
    model: str
    _blocks: list[_Block] = field(default_factory=list, init=False)
    _open: _Block | None = field(default=None, init=False)
    _calls: dict[int, _Block] = field(default_factory=dict, init=False)  # chat call index -> its block
    _pending_space: str = field(default="", init=False)
    _stop_reason: str | None = field(default=None, init=False)
    _stop_sequence: str | None = field(default=None, init=False)
    _usage: dict[str, Any] = field(default_factory=lambda: wire.usage(0, 0, 0), init=False)
    _metrics: dict[str, Any] | None = field(default=None, init=False)

    def message(self) -> dict[str, Any]:
        return wire.message_object(self.message_id, self.model, [b.wire() for b in self._blocks],
                                   self._stop_reason, self._stop_sequence, self._usage, self._metrics)

    def start(self, usage: dict[str, Any]) -> list[Event]:
        self._usage = usage
        return [{"type": "message_start", "message": self.message()}, {"type": "ping"}]

    def _close(self) -> list[Event]:
        block, self._open = self._open, None
        return [] if block is None else [{"type": "content_block_stop", "index": block.index}]

    def _append(self, block: _Block, text: str) -> list[Event]:
        block.text += text
        return [{"type": "content_block_delta", "index": block.index, "delta": block.delta(text)}]

    def _open_block(self, block: _Block) -> list[Event]:
        events = self._close()
        self._blocks.append(block)
        self._open = block
        return events + [{"type": "content_block_start", "index": block.index, "content_block": block.start()}]

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            if kind == "text" and not (self._pending_space + text).strip():
                self._pending_space += text
                return []
            events += self._open_block(_Block(kind, len(self._blocks)))
        if kind == "text":
            text, self._pending_space = self._pending_space + text, ""
        assert self._open is not None
        return events + self._append(self._open, text)

    def _call(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        function = delta.get("function") or {}
        block = self._calls.get(delta.get("index", 0))
        if block is None:
            self._pending_space = ""  # whitespace between text and a call belongs to neither
            block = _Block("tool_use", len(self._blocks), id=_tool_use_id(delta.get("id") or ""),
                           name=function.get("name") or "")
            self._calls[delta.get("index", 0)] = block
            events += self._open_block(block)
        fragment = function.get("arguments") or ""
        return events + (self._append(block, fragment) if fragment else [])

    def feed(self, delta: dict[str, Any]) -> list[Event]:
        """Events for one chat delta."""
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    @property
    def made_calls(self) -> bool:
        return bool(self._calls)

    def finish(self, finish_reason: str | None, stop_string: str | None, usage: dict[str, Any],
               metrics: dict[str, Any] | None = None) -> list[Event]:
        """Close the open block and end the message (stop_reason, stop_sequence, the final usage, and ``metrics``
        beside it where there are some)."""
        events: list[Event] = []
        if not any(b.kind != "thinking" for b in self._blocks):  # an answer has its (possibly empty) text
            events += self._open_block(_Block("text", len(self._blocks)))
            if self._pending_space:
                events += self._append(self._blocks[-1], self._pending_space)
        events += self._close()
        self._stop_reason = wire.stop_reason(finish_reason, stop_string, self.made_calls)
        self._stop_sequence = stop_string
        self._usage, self._metrics = usage, metrics
        delta = {"type": "message_delta", "delta": {"stop_reason": self._stop_reason,
                                                     "stop_sequence": self._stop_sequence}, "usage": usage}
        if metrics is not None:
            delta["metrics"] = metrics
        return [*events, delta, {"type": "message_stop"}]
