"""The core thread's inbox (engine.core_inbox): order kept, adds refused once closed, unread adds handed back."""

from __future__ import annotations

from engine.core_inbox import SHUTDOWN, CoreInbox
from engine.core_wire import AbortRequests
from engine.scheduler import Request
from engine.types import SamplingParams


def test_items_come_out_in_order_and_close_returns_the_adds_never_taken() -> None:
    inbox = CoreInbox()
    first, second = Request("a", [1], SamplingParams()), Request("b", [2], SamplingParams())
    assert inbox.add(first)
    inbox.abort(["a"], 1)
    inbox.shutdown()
    assert inbox.add(second)
    assert inbox.get(block=False) is first
    assert inbox.get(block=False) == AbortRequests(["a"], 1)
    assert inbox.get(block=False) is SHUTDOWN
    assert inbox.close() == [second]
    assert inbox.empty()
    assert not inbox.add(Request("c", [3], SamplingParams()))  # closed: refused, nothing queued
    assert inbox.empty()
