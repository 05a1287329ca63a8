"""The responses the server keeps (`store: true` on /v1/responses), so a later request continues a conversation
by `previous_response_id` instead of resending it; its prompt then starts with the stored turns, which the prefix
cache already holds, so a long agent session costs only its new turn.

Per owner (the tenant, as tenant isolation names it; None when isolation is off), bounded: the least recently
used response goes first once `max_responses` are kept. A response holds the whole conversation as messages
(the previous ones, its input, its answer), so a chain of any length is one lookup.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 4096


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object as it was answered
    messages: tuple[dict[str, Any], ...]  # the conversation up to and including its answer (calls included)


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be >= 1, got {max_responses}")
        self.max_responses = max_responses
        self._items: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # handlers run on the event loop, but tests and tools may call from others

    def put(self, owner: str | None, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[(owner, response_id)] = stored
            self._items.move_to_end((owner, response_id))
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """Another owner's response is not found, as if it did not exist."""
        with self._lock:
            stored = self._items.get((owner, response_id))
            if stored is not None:
                self._items.move_to_end((owner, response_id))
            return stored

    def delete(self, owner: str | None, response_id: str) -> bool:
        with self._lock:
            return self._items.pop((owner, response_id), None) is not None

    def __len__(self) -> int:
        return len(self._items)
