"""The responses ``/v1/responses`` stored (``store`` true, OpenAI's default), in memory: what
``GET /v1/responses/{id}`` answers and what ``previous_response_id`` continues.

Bounded three ways (config.properties, docs/configuration.md): ``responses_store_max_entries``,
``responses_store_max_bytes`` (the response objects and conversations held, as JSON) and
``responses_store_max_age_sec``. Past a bound the oldest entries go first; an entry larger than
the byte bound alone is not stored. Each entry belongs to an owner (the inference key that made
it): another owner's entry reads as absent. The store is lost on restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

#: Bytes counted per entry beside its JSON: the id, owner and bookkeeping of the entry.
ENTRY_OVERHEAD = 256


@dataclass(frozen=True)
class StoreLimits:
    """The store's bounds (defaults: those of config.properties)."""

    max_entries: int = 10_000
    max_bytes: int = 128 * 1024 * 1024
    max_age_s: float = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its response object and the conversation (chat messages, the
    instructions left out, as OpenAI's) that ends with its output, both JSON."""

    owner: str
    response: bytes
    conversation: bytes
    stored_at: float  # the store's clock (monotonic seconds)

    @property
    def size(self) -> int:
        """Bytes it counts against ``max_bytes``."""
        return len(self.response) + len(self.conversation) + ENTRY_OVERHEAD


class ResponseStore:
    """Stored responses by id, oldest first; every call is O(1) but for evictions, each of which
    removes an entry (so a call's work is bounded by the entries it stored before)."""

    def __init__(self, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, owner: str, response: bytes, conversation: bytes) -> bool:
        """Store a response (replacing one of the same id); False when it alone exceeds ``max_bytes``."""
        self.delete(response_id, None)
        entry = StoredResponse(owner, response, conversation, self.clock())
        if entry.size > self.limits.max_bytes:
            return False
        self._expire()
        while self._entries and (len(self._entries) >= self.limits.max_entries
                                 or self.bytes + entry.size > self.limits.max_bytes):
            self._pop_oldest()
        self._entries[response_id] = entry
        self.bytes += entry.size
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The entry of ``response_id`` made by ``owner``; ``None`` when absent, expired or another's."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str | None) -> bool:
        """Remove the entry (``owner`` ``None``: whoever made it); whether there was one to remove."""
        entry = self._entries.get(response_id)
        if entry is None or (owner is not None and entry.owner != owner):
            return False
        del self._entries[response_id]
        self.bytes -= entry.size
        return True

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.bytes -= entry.size

    def _expire(self) -> None:
        oldest = self.clock() - self.limits.max_age_s
        while self._entries and next(iter(self._entries.values())).stored_at < oldest:
            self._pop_oldest()
