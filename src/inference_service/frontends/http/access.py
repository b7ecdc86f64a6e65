"""The access log of the HTTP APIs (8080, 8081, ``/v1``, ``/v2``): :func:`install_access_log` puts a
middleware in front of an application's own, so it sees the status the client gets, and counts
a stream's chunks. Format: :mod:`inference_service.observability.accesslog`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from inference_service.errors import shorten
from inference_service.frontends.request_ids import ACCESS_MODEL, REQUEST_ID_HEADER, request_id
from inference_service.observability.accesslog import AccessLog
from inference_service.serving.core import SERVED_VERSION

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: The status logged for a request whose client went away before the answer (nginx's).
CLIENT_CLOSED = 499


def peer_of(request: web.Request) -> str:
    """The client's address in gRPC's form (``ipv4:127.0.0.1:50312``, ``ipv6:[::1]:50312``); "" unknown."""
    transport = request.transport
    peername: Any = transport.get_extra_info("peername") if transport is not None else None
    if not isinstance(peername, tuple) or len(peername) < 2:
        return ""
    host, port = peername[0], peername[1]
    return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"


def install_access_log(app: web.Application, access_log: AccessLog | None,
                       count: Callable[[int], None] | None = None) -> None:
    """Give every request of ``app`` its request id (``request["request_id"]``, echoed as
    ``X-Request-Id``) and log it on ``access_log`` (``None``: not logged, nothing measured);
    ``count`` gets each answer's status as its head goes out. Call before the application starts."""

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        """Echo the request id; wrap the response's ``write`` (per instance) to count a stream's chunks."""
        if count is not None:
            count(response.status)
        rid = request.get("request_id")
        if rid is not None:
            response.headers["X-Request-Id"] = rid
        counter = request.get("access_log_writes")
        if counter is None:
            return
        write = response.write

        async def counted(data: bytes | bytearray | memoryview) -> None:
            counter[0] += 1
            await write(data)

        response.write = counted  # type: ignore[method-assign]

    @web.middleware
    async def name_request(request: web.Request, handler: _Handler) -> web.StreamResponse:
        request["request_id"] = request_id(request.headers.get(REQUEST_ID_HEADER))
        return await handler(request)

    if access_log is not None:
        app.middlewares.insert(0, _log_requests(access_log))
    app.middlewares.insert(0, name_request)  # outermost: the id exists for every inner middleware
    app.on_response_prepare.append(on_prepare)


def _log_requests(access_log: AccessLog) -> Middleware:
    """The middleware writing each request's access line (its status, chunks, model and id)."""

    @web.middleware
    async def log_request(request: web.Request, handler: _Handler) -> web.StreamResponse:
        start = time.perf_counter()
        peer = peer_of(request)  # read while the connection is open
        writes = [0]
        request["access_log_writes"] = writes
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            if writes[0]:
                messages = writes[0]
            else:
                messages = 1 if status < 400 else 0
            match = request.match_info
            model = request.get(ACCESS_MODEL) or match.get("model_name", "")  # /v1: the body's model
            version = SERVED_VERSION.get() or match.get("model_version", "")  # the version that served it
            access_log.record_http(request.method, shorten(request.rel_url.raw_path), shorten(model),
                                   shorten(version), status, start, messages, peer, request["request_id"])

    return log_request
