"""RowHolds: which free KV rows an interactive request left recently, kept from batch lines (priority > 0) for a while
so that the prompt's KV stays for the next interactive request. Pure Python; no onnxruntime or numpy import.

NOTE(engine): a batch uses the capacity interactive traffic leaves idle; a row an interactive request just used is not
idle: a chat's next turn or an agent's next call usually starts with the same prompt (the prefix cache gives it back
in full, where a batch line would have overwritten it, and the request computes its whole prompt again: ~1.7 ms a token
of the default model on 2 cores). The price is a row of the batch's while interactive requests keep coming, nothing
once none came for ``hold_s``; and an interactive request that arrives finds a free row instead of taking a batch
line's (whose work is then computed again).
"""

from __future__ import annotations

from collections.abc import Iterable

# seconds a row an interactive request left is kept from batch lines
INTERACTIVE_HOLD_S = 10.0


class RowHolds:
    """Free rows held for interactive requests until a time (``time.monotonic`` seconds)."""

    def __init__(self, hold_s: float = INTERACTIVE_HOLD_S) -> None:
        self.hold_s = hold_s
        self._until: dict[int, float] = {}  # slot -> held until

    def hold(self, slot: int, now: float) -> None:
        """An interactive request left ``slot`` (its KV kept for reuse) at ``now``."""
        if self.hold_s > 0:
            self._until[slot] = now + self.hold_s

    def taken(self, slot: int) -> None:
        """A request took ``slot``: whatever it held is gone."""
        self._until.pop(slot, None)

    def open_to_batch(self, free: Iterable[int], now: float) -> list[int]:
        """The rows of ``free`` a batch line may take at ``now`` (ascending)."""
        until = self._until
        return sorted(s for s in free if until.get(s, 0.0) <= now)
