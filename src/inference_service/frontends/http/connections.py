"""What aiohttp lacks against clients that hold connections without finishing a request: a
deadline for a request's head, a floor on a body's rate, caps on connections per port and per
client address.

aiohttp's own ``keepalive_timeout`` (``connection_idle_timeout_sec``) closes a connection idle
between requests. :class:`ConnectionGuard` wraps each connection's aiohttp protocol and adds, per port:

- a cap (``http_max_connections``) and, within it, a cap per client address
  (``http_max_connections_per_address``, by default a quarter of the port's, so that no two
  addresses fill it; an IPv6 client counts by its /64). At either cap a new connection first
  takes the place of the oldest keep-alive connection idle between requests (of that address,
  or of the port); with none idle it is answered 503 with TorchServe's JSON body and closed
  before aiohttp sees it, so one client never holds the places of the others;
- a reserve past the port's cap (:func:`reserve_of`) for health checks: a connection admitted
  there is served ``/ping`` and the health routes (:data:`HEALTH_PATHS`), 503 else;
- a 401 or 403 answer closes its connection (a client without a key holds no place);
- a deadline for a request's head (``request_head_timeout_sec``), counted from the connection's
  start for its first request (a connection that sends nothing ends then), else from the head's
  first byte;
- a floor on a body's rate (``http_body_min_rate`` bytes/s on average, checked once the head
  deadline has passed since the head): a body that trickles gets 408 and the connection closes.

One sweep per port, every half second, checks the connections; nothing runs per byte but a
counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from inference_service.connection_limits import ConnectionLimits

log = logging.getLogger("inference_service.http")

SWEEP_S = 0.5
#: Routes a connection admitted in the reserve past the port's cap may be served.
HEALTH_PATHS = frozenset({"/ping", "/v2/health/live", "/v2/health/ready"})
#: A keep-alive connection idle for less than this is not taken over (its answer may be
#: still going out).
IDLE_EVICT_AFTER_S = 0.5


def reserve_of(cap: int) -> int:
    """Connections a port admits past its cap ``cap`` for health checks: 2 %, at least 4."""
    return max(4, cap // 50)


def _raw_answer(status: int, reason: str, kind: str, message: str) -> bytes:
    body = json.dumps({"code": status, "type": kind, "message": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def client_address(transport: asyncio.BaseTransport) -> str | None:
    """The address a connection counts against: its peer's IP (an IPv6 peer's /64 network; an
    IPv4-mapped one as IPv4); ``None`` for a Unix socket."""
    peer = transport.get_extra_info("peername")
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return None
    try:
        ip = ipaddress.ip_address(peer[0].split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol behind a byte counter and the guard's deadlines."""

    def __init__(self, guard: ConnectionGuard, inner: Any) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.address: str | None = None
        self.received = 0
        self.head_started: float | None = None  # start of a head not yet parsed (the connection's, then its first byte)
        self.request: web.Request | None = None  # the request in progress
        self.request_started = 0.0
        self.received_at_request = 0
        self.idle_since: float | None = None  # between requests, nothing received since the last answer
        self.health_only = False  # admitted in the reserve past the port's cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        guard = self.guard
        self.address = client_address(transport)
        refusal = guard.admit(self)
        if refusal is None:
            guard.connections[transport] = self
            if self.address is not None:
                guard.per_address[self.address] = guard.per_address.get(self.address, 0) + 1
            self.head_started = time.monotonic()
            self.inner.connection_made(transport)
            return
        guard.refused += 1
        if guard.refused in (1, 10, 100, 1000) or guard.refused % 10_000 == 0:
            log.warning("%s: %d connections refused past http_max_connections=%d or "
                        "http_max_connections_per_address=%d (the last from %s)", guard.api, guard.refused,
                        guard.cap, guard.address_cap, self.address)
        transport.write(refusal)  # type: ignore[attr-defined]
        transport.close()
        self.inner = None

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.request is None and self.head_started is None:
            self.head_started = time.monotonic()
            if self.idle_since is not None:
                self.guard.busy(self)
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.guard.forget(self.transport)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def expired(self, now: float, limits: ConnectionLimits) -> str | None:
        """Why this connection is past a deadline ("" for none)."""
        if self.request is None:
            if self.head_started is not None and now - self.head_started > limits.request_head_timeout_s:
                return f"no complete request head within request_head_timeout_sec={limits.request_head_timeout_s:g}"
            return None
        elapsed = now - self.request_started
        if limits.body_min_rate and elapsed > limits.request_head_timeout_s and not self.request.content.is_eof():
            rate = (self.received - self.received_at_request) / elapsed
            if rate < limits.body_min_rate:
                return f"the body came at {rate:.0f} bytes/s, below http_body_min_rate={limits.body_min_rate}"
        return None


class ConnectionGuard:
    """The cap, head deadline and body-rate floor of one HTTP port (see the module docstring).

    Args:
        limits: the server's connection limits.
        cap: connections this port may hold (``max_connections`` lowered to the open-file limit).
        api: the port's name for log lines ("HTTP inference API").
    """

    def __init__(self, limits: ConnectionLimits, cap: int, api: str) -> None:
        self.limits = limits
        self.cap = cap
        self.address_cap = min(cap, limits.max_connections_per_address or max(1, cap // 4))
        self.reserve = reserve_of(cap)
        self.api = api
        self.connections: dict[asyncio.BaseTransport, _Guarded] = {}
        self.per_address: dict[str, int] = {}  # open connections per client address
        self.idle: dict[_Guarded, None] = {}  # keep-alive connections between requests, oldest first
        self.idle_per_address: dict[str, dict[_Guarded, None]] = {}
        self.health_only = 0  # connections open in the reserve
        self.refused = 0
        self.evicted = 0
        self.refusal = _raw_answer(503, "Service Unavailable", "ServiceUnavailableException",
                                   f"too many connections: http_max_connections={cap}")
        self.address_refusal = _raw_answer(
            503, "Service Unavailable", "ServiceUnavailableException",
            f"too many connections from one address: http_max_connections_per_address={self.address_cap}")
        self._timeout = _raw_answer(408, "Request Timeout", "RequestTimeoutException", "request too slow")
        self._sweeper: asyncio.Task[None] | None = None

    def admit(self, new: _Guarded) -> bytes | None:
        """Make room for ``new`` (taking over an idle keep-alive connection where one is due), or
        the refusal to send it."""
        address = new.address
        if address is not None and self.per_address.get(address, 0) >= self.address_cap:
            if not self._evict(self.idle_per_address.get(address)):
                return self.address_refusal
        if len(self.connections) - self.health_only >= self.cap and not self._evict(self.idle):
            if self.health_only >= self.reserve:
                return self.refusal
            new.health_only = True
            self.health_only += 1
        return None

    def _evict(self, idle: dict[_Guarded, None] | None) -> bool:
        """Close the oldest connection of ``idle`` if it has been idle long enough; whether it was."""
        oldest = next(iter(idle), None) if idle else None
        if oldest is None or oldest.idle_since is None or oldest.transport is None \
                or time.monotonic() - oldest.idle_since < IDLE_EVICT_AFTER_S:
            return False
        self.evicted += 1
        if self.evicted in (1, 10, 100, 1000) or self.evicted % 10_000 == 0:
            log.info("%s: %d idle keep-alive connections closed to admit new ones (the last from %s)",
                     self.api, self.evicted, oldest.address)
        oldest.transport.close()
        self.forget(oldest.transport)
        return True

    def went_idle(self, guarded: _Guarded) -> None:
        """``guarded`` finished a request and waits for the next (a keep-alive connection)."""
        if guarded.transport not in self.connections:
            return
        guarded.idle_since = time.monotonic()
        self.idle[guarded] = None
        if guarded.address is not None:
            self.idle_per_address.setdefault(guarded.address, {})[guarded] = None

    def busy(self, guarded: _Guarded) -> None:
        """``guarded`` is no longer idle (bytes of a request arrived, or it closed)."""
        guarded.idle_since = None
        self.idle.pop(guarded, None)
        if guarded.address is not None:
            of_address = self.idle_per_address.get(guarded.address)
            if of_address is not None:
                of_address.pop(guarded, None)
                if not of_address:
                    del self.idle_per_address[guarded.address]

    def forget(self, transport: asyncio.BaseTransport) -> None:
        """A connection no longer counts (closed, or being closed)."""
        guarded = self.connections.pop(transport, None)
        if guarded is None:
            return
        self.busy(guarded)
        if guarded.health_only:
            self.health_only -= 1
        if guarded.address is not None:
            left = self.per_address.get(guarded.address, 1) - 1
            if left > 0:
                self.per_address[guarded.address] = left
            else:
                self.per_address.pop(guarded.address, None)

    def factory(self, inner: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` around aiohttp's (``runner.server``)."""
        return lambda: _Guarded(self, inner())

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Any]) -> Any:
        """Marks the connection's request in progress (its head arrived) until the answer is
        written; serves a connection of the reserve its health routes only; closes the connection
        of a 401 or 403."""
        guarded = self.connections.get(request.transport) if request.transport is not None else None
        if guarded is None:
            return await handler(request)
        if guarded.idle_since is not None:  # a pipelined request, its bytes already read
            self.busy(guarded)
        guarded.request, guarded.head_started = request, None
        guarded.request_started, guarded.received_at_request = time.monotonic(), guarded.received
        closes = True
        try:
            if guarded.health_only and request.path not in HEALTH_PATHS:
                response = web.Response(body=self.refusal.split(b"\r\n\r\n", 1)[1], status=503,
                                        content_type="application/json")
            else:
                response = await handler(request)
            closes = guarded.health_only or response.status in (401, 403)
            if closes:
                response.force_close()
            return response
        finally:
            guarded.request = None
            if not closes and guarded.transport is not None and not guarded.transport.is_closing():
                self.went_idle(guarded)

    def start(self) -> None:
        """Start the sweep (in the running loop)."""
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name=f"{self.api} connection guard")

    async def stop(self) -> None:
        """Stop the sweep."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep(self) -> None:
        closed = 0
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for transport, guarded in list(self.connections.items()):
                why = guarded.expired(now, self.limits)
                if why is None:
                    continue
                closed += 1
                if closed in (1, 10, 100, 1000) or closed % 10_000 == 0:
                    log.info("%s: closed a connection (%d so far): %s", self.api, closed, why)
                if guarded.request is None or not guarded.request.content.is_eof():
                    with contextlib.suppress(Exception):
                        transport.write(self._timeout)  # type: ignore[attr-defined]
                transport.close()
                self.forget(transport)


class GuardedSite(web.SockSite):
    """aiohttp's ``SockSite`` whose connections go through a :class:`ConnectionGuard` (the
    protocol factory is the one thing ``SockSite.start`` does not let a caller choose)."""

    def __init__(self, runner: web.BaseRunner, sock: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(runner, sock, **kwargs)
        self.guard = guard

    async def start(self) -> None:
        """Register the site with its runner, listen through the guard, start the guard's sweep."""
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.factory(server), sock=self._sock, ssl=self._ssl_context, backlog=self._backlog)
        self.guard.start()

    async def stop(self) -> None:
        """Stop listening and the guard's sweep."""
        await self.guard.stop()
        await super().stop()
