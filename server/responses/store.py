"""The bounded in-memory store of Responses (store=true): GET/DELETE /v1/responses/{id} and previous_response_id.

Not persistent: it lives in the server process and is empty after a restart. Bounded by a count and by an
estimate of the bytes held; the least recently used responses are evicted first. Used only from the event
loop (no locks). No engine import.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    """One finished response and what a follow-up needs.

    Attributes:
        body: the Response object as the client received it.
        conversation: the chat messages of the whole conversation up to and including this response's
            output, without its instructions (a follow-up's own instructions replace them, as OpenAI does).
        input_items: this request's input items, each with an id (GET .../input_items).
        num_bytes: the estimate the byte bound counts.
    """

    body: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    input_items: tuple[dict[str, Any], ...]
    num_bytes: int


def make_stored(body: dict[str, Any], conversation: list[dict[str, Any]],
                input_items: list[dict[str, Any]]) -> StoredResponse:
    size = sum(len(json.dumps(part, ensure_ascii=False)) for part in (body, conversation, input_items))
    return StoredResponse(body, tuple(conversation), tuple(input_items), size)


class ResponseStore:
    """An LRU of StoredResponses, at most `max_responses` of them and about `max_bytes` in all.

    Args:
        max_responses: 0 keeps nothing (GET and previous_response_id then always answer 404 / 400).
        max_bytes: a response larger than this alone is not kept.
    """

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self.delete(response_id)
        if self.max_responses == 0 or stored.num_bytes > self.max_bytes:
            logger.debug("not storing %s (%d bytes; bound %d responses, %d bytes)", response_id, stored.num_bytes,
                         self.max_responses, self.max_bytes)
            return
        self._entries[response_id] = stored
        self._num_bytes += stored.num_bytes
        while len(self._entries) > self.max_responses or self._num_bytes > self.max_bytes:
            evicted_id, evicted = self._entries.popitem(last=False)
            self._num_bytes -= evicted.num_bytes
            logger.debug("evicted stored response %s", evicted_id)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is None:
            return False
        self._num_bytes -= stored.num_bytes
        return True
