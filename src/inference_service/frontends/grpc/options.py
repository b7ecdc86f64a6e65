"""The options of this server's ``grpc.aio`` servers: message size limits, the backlog of
calls, and the limits on client connections (docs/security.md, docs/configuration.md).
"""

from __future__ import annotations

from typing import Any

from inference_service.config import Settings

PENDING_CALLS = 20_000
"""Calls gRPC holds for the server before the event loop takes them (beyond: CANCELLED by gRPC)."""


def server_options(settings: Settings, age_ms: int | None, grace_ms: int | None) -> list[tuple[str, Any]]:
    """The options of one gRPC server (``age_ms`` / ``grace_ms``: its API's connection age
    settings, ``None``: gRPC's default, unlimited)."""
    # gRPC's own limits sit above the settings, so that the core can refuse an oversize
    # request or response with a message naming the setting; beyond twice the setting
    # gRPC refuses the message itself (also RESOURCE_EXHAUSTED).
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", 2 * settings.max_request_size + (1 << 20)),
        ("grpc.max_send_message_length", settings.max_response_size + (1 << 20)),
        ("grpc.so_reuseport", 0),
        # Calls that arrived but that the event loop has not picked up yet: above gRPC's
        # default backlog (1,000, random refusals up to 3,000) a burst on one connection had
        # calls dropped as CANCELLED, which clients do not retry; with room for a burst every
        # call reaches the core, which answers RESOURCE_EXHAUSTED when the job queue is full.
        ("grpc.server.max_pending_requests", PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS),
        # hostile clients: a connection must finish its handshake (HTTP/2 preface and SETTINGS)
        # in time, holds a bounded number of streams (which also bounds what resets can cost),
        # and is closed (GOAWAY) when it has no call for idle_timeout_s (connection_limits.py)
        ("grpc.server_handshake_timeout_ms", int(settings.connections.request_head_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", int(settings.connections.idle_timeout_s * 1000)),
    ]
    if settings.connections.max_concurrent_streams:
        options.append(("grpc.max_concurrent_streams", settings.connections.max_concurrent_streams))
    if age_ms:
        options.append(("grpc.max_connection_age_ms", age_ms))
    if grace_ms:
        options.append(("grpc.max_connection_age_grace_ms", grace_ms))
    return options
