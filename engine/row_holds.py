"""RowHolds: the free KV row the last interactive request left, kept from batch lines (priority > 0) for a while so
that its prompt's KV stays for the next interactive request. Pure Python; no onnxruntime or numpy import.

NOTE(engine): a batch uses the capacity interactive traffic leaves idle; a row an interactive request just used is not
idle: a chat's next turn or an agent's next call usually starts with the same prompt (the prefix cache gives it back
in full, where a batch line would have overwritten it, and the request computes its whole prompt again: ~1.7 ms a token
of the default model on 2 cores). One row at most, so a batch always has every other row (and never waits on an
empty engine): the price is one row of the batch's while interactive requests keep coming, nothing once none came for
``hold_s``; and an interactive request that arrives finds a free row instead of taking a batch line's (whose work is
then computed again).
"""

from __future__ import annotations

from collections.abc import Iterable

# seconds the row the last interactive request left is kept from batch lines
INTERACTIVE_HOLD_S = 10.0


class RowHolds:
    """The one free row held for interactive requests, until a time (``time.monotonic`` seconds).

    Args:
        hold_s: how long; 0: never hold (a scheduler of one row holds none: its batch lines would wait on nothing).
    """

    def __init__(self, hold_s: float = INTERACTIVE_HOLD_S) -> None:
        self.hold_s = hold_s
        self._slot: int | None = None
        self._until = 0.0

    def hold(self, slot: int, now: float) -> None:
        """An interactive request left ``slot`` (its KV kept for reuse) at ``now``: it is the held row now."""
        if self.hold_s > 0:
            self._slot, self._until = slot, now + self.hold_s

    def taken(self, slot: int) -> None:
        """A request took ``slot``: whatever it held is gone."""
        if slot == self._slot:
            self._slot = None

    def open_to_batch(self, free: Iterable[int], now: float) -> list[int]:
        """The rows of ``free`` a batch line may take at ``now`` (ascending)."""
        held = self._slot if self._until > now else None
        return sorted(s for s in free if s != held)
