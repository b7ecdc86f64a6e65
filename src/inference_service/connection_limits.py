"""Limits on client connections, read once into :class:`ConnectionLimits` (a field of
``Settings``), and the open-file limit they rest on.

The libraries' own settings do the work where they have one (gRPC's handshake timeout,
``max_concurrent_streams`` and ``max_connection_idle_ms``, aiohttp's keep-alive timeout);
what aiohttp lacks (a deadline for a request's head, a floor on a body's rate, caps on
connections per port and per client address) is ``frontends/http/connections.py``.
"""

from __future__ import annotations

import logging
import resource
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

#: config.properties key -> (``ConnectionLimits`` field, lowest, highest).
CONNECTION_KEYS: dict[str, tuple[str, float, float]] = {
    "request_head_timeout_sec": ("request_head_timeout_s", 0.1, 3600.0),
    "connection_idle_timeout_sec": ("idle_timeout_s", 0.1, 86_400.0),
    "http_body_min_rate": ("body_min_rate", 0, 1 << 30),
    "http_max_connections": ("max_connections", 1, 1_000_000),
    "http_max_connections_per_address": ("max_connections_per_address", 0, 1_000_000),
    "grpc_max_concurrent_streams": ("max_concurrent_streams", 0, 1 << 20),
    "grpc_max_unread_bytes": ("max_unread_bytes", 0, 1 << 40),
    "grpc_unread_pause_timeout_sec": ("unread_pause_s", 0.0, 86_400.0),
}
#: Descriptors kept for everything but HTTP clients (gRPC, workers, archives, logs).
RESERVED_FDS = 256


@dataclass
class ConnectionLimits:
    """Limits on client connections (units in the names; ranges in :data:`CONNECTION_KEYS`).

    Attributes:
        request_head_timeout_s: an HTTP request's head must arrive within it (after the
            connection opens, or after its first byte when it follows an answer); gRPC: the
            connection's handshake (HTTP/2 preface and SETTINGS). 10 s.
        idle_timeout_s: a connection without a request in progress is closed after it (HTTP
            keep-alive; gRPC ``max_connection_idle_ms``, a GOAWAY). 60 s.
        body_min_rate: after ``request_head_timeout_s`` an HTTP body still arriving must have
            come at this many bytes/s on average, else 408 and the connection closes (0: off).
            1024.
        max_connections: open connections per HTTP port; past it a new one is answered 503
            and closed. Lowered at start to what the open-file limit leaves. 1000.
        max_connections_per_address: of those, what one client address (an IPv6 /64) may
            hold; past it its oldest idle connection is closed for the new one, else 503 and
            closed. 0: a quarter of the port's cap.
        max_concurrent_streams: concurrent gRPC calls per connection (HTTP/2
            ``SETTINGS_MAX_CONCURRENT_STREAMS``; a client queues the others, but calls opened
            in a burst past it may be refused with UNAVAILABLE, REFUSED_STREAM). It bounds what
            zero-window readers and rapid resets cost. 100; 0: gRPC's default, no limit.
        max_unread_bytes: bytes of gRPC answers (of 64 KiB and more) a connection's client has
            not taken yet, and again bytes of answers waiting for room (paused): past the first,
            an answer waits; past both, or after ``unread_pause_s`` waiting, its call ends
            RESOURCE_EXHAUSTED. One answer always goes. 16 MiB; 0: no limit.
        unread_pause_s: how long an answer waits for room in ``max_unread_bytes``. 60 s.
    """

    request_head_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    body_min_rate: int = 1024
    max_connections: int = 1000
    max_connections_per_address: int = 0
    max_concurrent_streams: int = 100
    max_unread_bytes: int = 16 << 20
    unread_pause_s: float = 60.0


def parser(key: str) -> Any:
    """The config.properties parser of ``key`` (a :data:`CONNECTION_KEYS` key): a number in range.

    The parser raises ValueError naming the range."""
    _, low, high = CONNECTION_KEYS[key]

    def parse(value: str) -> float:
        number = (int if isinstance(low, int) else float)(value.strip())
        if not low <= number <= high:
            raise ValueError(f"must be from {low:g} to {high:g}")
        return number

    return parse


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit (``RLIMIT_NOFILE``) to the hard one; returns the soft
    limit now in force (a common default soft limit, 1,024, is exhausted by that many idle
    clients)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard or hard == resource.RLIM_INFINITY and soft < 1 << 20:
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def connection_cap(limits: ConnectionLimits, open_files: int, http_ports: int) -> int:
    """Connections one HTTP port may hold: ``max_connections``, lowered so that every HTTP
    port full still leaves :data:`RESERVED_FDS` descriptors (and half the rest) to the server."""
    share = max(16, (open_files - RESERVED_FDS) // (2 * max(1, http_ports)))
    if share < limits.max_connections:
        log.warning("http_max_connections %d lowered to %d per port: the open-file limit is %d",
                    limits.max_connections, share, open_files)
        return share
    return limits.max_connections


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """The standard library's threading HTTP server (the metrics port) holding at most ``cap``
    connections (one thread each): past it a new connection is closed at once
    (``verify_request``, the library's hook). Give its handler a ``timeout`` too, so that a
    connection that sends nothing or half a head ends."""

    cap = 1000
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog (the library's default, 5, stalls a burst of connects)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open = 0
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Whether there is room for one more connection."""
        return self._open < self.cap

    def process_request(self, request: Any, client_address: Any) -> None:
        """Count the connection, then serve it in its thread."""
        with self._open_lock:
            self._open += 1
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve the connection; it no longer counts once done."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1
