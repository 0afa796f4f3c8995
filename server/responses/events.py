"""The Responses API's output side: chat-style deltas -> output items, the streamed events, and the Response.

One ResponseAssembler serves both the streamed answer (its events) and the collected one (its final
response()), so the body of `response.completed` and the non-streamed body are the same object. Pure: no
I/O, no engine import; wire objects come from server.responses.protocol.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from server.responses import protocol as wire

Event = dict[str, Any]


@dataclass
class _Item:
    """One output item being built: a message (text) or a function call (arguments)."""

    id: str
    kind: str  # "message" | "function_call" | "reasoning"
    output_index: int
    text: str = ""  # message text, the call's arguments so far, or the thinking
    call_id: str = ""
    name: str = ""
    namespace: str | None = None  # a call's namespace tool
    status: str = "in_progress"
    has_part: bool = False  # a message's output_text part was announced (content_part.added)

    def wire(self) -> dict[str, Any]:
        if self.kind == "message":
            parts = [wire.output_text_part(self.text)] if self.has_part else []
            return wire.message_item(self.id, self.status, parts)
        if self.kind == "reasoning":
            return wire.reasoning_item(self.id, self.status, self.text)
        return wire.function_call_item(self.id, self.status, self.call_id, self.name, self.text, self.namespace)


@dataclass
class ResponseAssembler:
    """The item state machine of one response.

    Feed it chat deltas, as the chat path makes them: ``{"content": text}`` and ``{"tool_calls": [{"index",
    "id", "function": {"name", "arguments"}}]}`` (the first delta of a call carries its id and name, later
    ones argument fragments). One output item is open at a time: switching from text to a call (or to the
    next call) closes the open item and opens the next. Every method returns the events it caused, each
    with its ``sequence_number``.

    Usage::

        asm = ResponseAssembler(skeleton)
        events = asm.start()                      # response.created, response.in_progress
        events += asm.feed({"content": "Hi"})     # output_item.added, content_part.added, output_text.delta
        events += asm.finish("stop", usage)       # ... output_item.done, response.completed
        body = asm.response()                     # the same object response.completed carried

    NOTE(server): text that is only whitespace is held back until non-space text follows, so a model that
    writes a newline before a call does not leave an empty message item; at the end, an answer with no
    item at all still gets its (possibly empty) message.
    """

    skeleton: dict[str, Any]  # id, created_at, model and the request's echo (protocol_responses.response_skeleton)
    names: wire.ToolNames | None = None  # chat names of the tools -> (namespace, name) they were declared with
    _sequence: int = field(default=0, init=False)
    _items: list[_Item] = field(default_factory=list, init=False)
    _open: _Item | None = field(default=None, init=False)
    _calls: dict[int, _Item] = field(default_factory=dict, init=False)  # the chat delta's call index -> its item
    _pending_space: str = field(default="", init=False)
    _status: str = field(default="in_progress", init=False)
    _usage: dict[str, Any] | None = field(default=None, init=False)
    _error: dict[str, Any] | None = field(default=None, init=False)
    _incomplete_reason: str | None = field(default=None, init=False)
    _completed_at: int | None = field(default=None, init=False)
    _metrics: dict[str, Any] | None = field(default=None, init=False)

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def response(self) -> dict[str, Any]:
        """The Response object as it stands (status in_progress until finish() or fail())."""
        return wire.response_object(self.skeleton, self._status, [item.wire() for item in self._items],
                                    self._usage, self._error, self._incomplete_reason, self._completed_at,
                                    self._metrics)

    def start(self) -> list[Event]:
        created = self.response()  # queued, for a background response
        self._status = "in_progress"
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=self.response())]

    # --- items --------------------------------------------------------------------------------------

    def _open_item(self, item: _Item) -> list[Event]:
        self._items.append(item)
        self._open = item
        events = [self._event("response.output_item.added", output_index=item.output_index, item=item.wire())]
        if item.kind == "message":
            item.has_part = True
            events.append(self._event("response.content_part.added", item_id=item.id,
                                      output_index=item.output_index, content_index=0,
                                      part=wire.output_text_part("")))
        return events

    def _close_open(self, status: str = "completed") -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "message":
            events = [self._event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=wire.output_text_part(item.text))]
        elif item.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, content_index=0, text=item.text)]
        else:
            events = [self._event("response.function_call_arguments.done", **where, name=item.name,
                                  arguments=item.text)]
        events.append(self._event("response.output_item.done", output_index=item.output_index, item=item.wire()))
        return events

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != "message":
            if not (self._pending_space + text).strip():
                self._pending_space += text
                return []
            events += self._close_open()
            events += self._open_item(_Item(wire.new_id("msg"), "message", len(self._items)))
        text, self._pending_space = self._pending_space + text, ""
        return events + self._append(text)

    def _append(self, text: str) -> list[Event]:
        item = self._open
        assert item is not None and item.kind == "message"
        item.text += text
        return [self._event("response.output_text.delta", item_id=item.id, output_index=item.output_index,
                            content_index=0, delta=text, logprobs=[])]

    def _call(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        item = self._calls.get(index)
        if item is None:
            events += self._close_open()
            self._pending_space = ""  # whitespace between text and a call belongs to neither
            namespace, name = self.names.declared(function.get("name") or "") if self.names is not None \
                else (None, function.get("name") or "")
            item = _Item(wire.new_id("fc"), "function_call", len(self._items), call_id=delta.get("id") or "",
                         name=name, namespace=namespace)
            self._calls[index] = item
            events += self._open_item(item)
        fragment = function.get("arguments") or ""
        if fragment:
            item.text += fragment
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=item.output_index, delta=fragment))
        return events

    def _thinking(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != "reasoning":
            events += self._close_open()
            events += self._open_item(_Item(wire.new_id("rs"), "reasoning", len(self._items)))
        item = self._open
        assert item is not None
        item.text += text
        return events + [self._event("response.reasoning_text.delta", item_id=item.id,
                                     output_index=item.output_index, content_index=0, delta=text)]

    def feed(self, delta: dict[str, Any]) -> list[Event]:
        """Events for one chat delta ({"reasoning_content": ...}, {"content": ...} and/or {"tool_calls": [...]})."""
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._thinking(delta["reasoning_content"])
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    # --- the end ------------------------------------------------------------------------------------

    def finish(self, finish_reason: str | None, usage: dict[str, Any],
               metrics: dict[str, Any] | None = None) -> list[Event]:
        """Close the open item and end the response: completed, or incomplete when the token limit cut it
        (``metrics``: the response's, beside its usage)."""
        cut = finish_reason == "length"
        events: list[Event] = []
        if all(item.kind == "reasoning" for item in self._items):  # an answer always has its message
            events += self._close_open("incomplete" if cut else "completed")
            events += self._open_item(_Item(wire.new_id("msg"), "message", len(self._items)))
            if self._pending_space:
                events += self._append(self._pending_space)
        events += self._close_open("incomplete" if cut else "completed")
        self._usage, self._metrics = usage, metrics
        if cut:
            self._status, self._incomplete_reason = "incomplete", "max_output_tokens"
            return [*events, self._event("response.incomplete", response=self.response())]
        self._status, self._completed_at = "completed", int(time.time())
        return [*events, self._event("response.completed", response=self.response())]

    def fail(self, message: str, usage: dict[str, Any] | None = None) -> list[Event]:
        """End the response as failed (the engine failed mid-way); items already made are kept as they are."""
        self._status = "failed"
        self._usage = usage
        self._error = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=self.response())]

    def cancel(self) -> None:
        """End the response as cancelled (POST .../cancel of a background response): no event, as OpenAI's."""
        if self._open is not None:
            self._open.status, self._open = "incomplete", None
        self._status = "cancelled"

    def queued(self) -> dict[str, Any]:
        """The Response as a background request first answers it: queued, nothing run yet."""
        self._status = "queued"
        return self.response()

    @property
    def status(self) -> str:
        return self._status

    @property
    def sequence_number(self) -> int:
        """The next event's sequence_number."""
        return self._sequence
