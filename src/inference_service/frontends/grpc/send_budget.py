"""A per-connection budget of answer bytes handed to gRPC and not yet taken by the client.

gRPC holds an answer until the client's HTTP/2 window lets it out; a client that grants no
window makes it hold every answer of every stream. :class:`SendBudget` caps those bytes per
connection (``grpc_max_unread_bytes``): past the cap an answer waits (paused) until the
client takes earlier ones, and ends RESOURCE_EXHAUSTED after ``grpc_unread_pause_timeout_sec``
or at once when the paused answers reach the cap too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from inference_service.errors import ResourceExhausted

#: Answers smaller than this are not counted (pings, tokens, statuses: bounded by the streams).
SMALL = 64 * 1024


@dataclass
class _Connection:
    sent: int = 0  # bytes handed to gRPC, the call not over (streams: the last two messages)
    paused: int = 0  # bytes of answers waiting for room
    changed: asyncio.Future[None] | None = field(default=None)


class SendBudget:
    """Answer bytes per connection (client address), shared by the servicers of one server.

    Args:
        limit: bytes handed to gRPC per connection, and again bytes paused (0: no budget).
        pause_s: how long an answer waits for room before its call ends.
    """

    def __init__(self, limit: int, pause_s: float) -> None:
        self.limit = limit
        self.pause_s = pause_s
        self._connections: dict[str, _Connection] = {}

    def call(self, peer: str) -> CallBudget | None:
        """The budget of one call from ``peer`` (``None`` when the budget is off)."""
        return CallBudget(self, peer) if self.limit > 0 else None

    def held(self, peer: str) -> tuple[int, int]:
        """(bytes sent, bytes paused) for ``peer``."""
        conn = self._connections.get(peer)
        return (conn.sent, conn.paused) if conn is not None else (0, 0)

    async def reserve(self, peer: str, size: int) -> None:
        """Count ``size`` bytes as sent for ``peer``, once they fit (see the module)."""
        conn = self._connections.setdefault(peer, _Connection())
        if conn.sent == 0 or conn.sent + size <= self.limit:
            conn.sent += size
            return
        if conn.paused and conn.paused + size > self.limit:
            self._forget_if_idle(peer, conn)
            raise self._refusal("paused answers fill")
        conn.paused += size
        deadline = time.monotonic() + self.pause_s
        try:
            while not (conn.sent == 0 or conn.sent + size <= self.limit):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._refusal(f"no room for {self.pause_s:g} s in")
                if conn.changed is None or conn.changed.done():
                    conn.changed = asyncio.get_running_loop().create_future()
                await asyncio.wait([conn.changed], timeout=left)
            conn.sent += size
        finally:
            conn.paused -= size
            self._forget_if_idle(peer, conn)

    def release(self, peer: str, size: int) -> None:
        """``size`` bytes of ``peer`` are no longer held by gRPC (taken, or the call ended)."""
        conn = self._connections.get(peer)
        if conn is None or size <= 0:
            return
        conn.sent -= size
        if conn.changed is not None and not conn.changed.done():
            conn.changed.set_result(None)
        self._forget_if_idle(peer, conn)

    def _forget_if_idle(self, peer: str, conn: _Connection) -> None:
        if conn.sent <= 0 and conn.paused <= 0 and self._connections.get(peer) is conn:
            del self._connections[peer]

    def _refusal(self, why: str) -> ResourceExhausted:
        return ResourceExhausted(
            f"the client has not read earlier answers on this connection: {why} "
            f"grpc_max_unread_bytes ({self.limit} bytes)", reason="CONNECTION_UNREAD_BYTES", retry_after_s=1.0)


class CallBudget:
    """What one call holds of its connection's budget: every answer until the call ends
    (unary), or the last two messages (streams: a written message may still sit in gRPC)."""

    def __init__(self, budget: SendBudget, peer: str) -> None:
        self.budget = budget
        self.peer = peer
        self._sizes: list[int] = []

    async def admit(self, message: Any) -> Any:
        """``message`` serialized (bytes) once it fits the budget, or the message itself when
        small; raises ResourceExhausted when it does not fit in time."""
        if isinstance(message, bytes) or not hasattr(message, "ByteSize") or message.ByteSize() < SMALL:
            return message
        raw = message.SerializeToString()
        del message
        # the message before the last one has been written (gRPC asked for the next one)
        while len(self._sizes) > 1:
            self.budget.release(self.peer, self._sizes.pop(0))
        await self.budget.reserve(self.peer, len(raw))
        self._sizes.append(len(raw))
        return raw

    def done(self, _context: Any = None) -> None:
        """The call is over: what it held is freed (idempotent)."""
        sizes, self._sizes = self._sizes, []
        for size in sizes:
            self.budget.release(self.peer, size)
