"""TorchServe's HTTP/1.1 inference API, over the same :class:`~inference_service.serving.core.InferenceCore`.

Served by aiohttp in the server's asyncio loop, beside the gRPC servers, on
``inference_address`` (default ``http://127.0.0.1:8080`` as TorchServe;
``--http-address`` / ``--http-port``, port 0 picks a free one; ``--no-http`` turns it off):

- ``GET /ping``: ``{"status": "Healthy"}`` (200) or ``{"status": "Unhealthy"}`` (500) while a
  model has fewer than its minimum workers, as TorchServe's ``/ping``.
- ``POST`` (or ``PUT``) ``/predictions/{model_name}[/{model_version}]``: the raw body becomes
  the input ``body``; a ``multipart/form-data`` or ``application/x-www-form-urlencoded`` body
  gives one input per field (the field's bytes under its name), as TorchServe's
  ``InferenceRequestHandler`` builds them. Request headers reach the handler
  (``context.get_request_header``), the ``Authorization`` header excepted.
  As TorchServe 0.12, the handler also gets the header ``url_path``: ``rest`` for
  ``/predictions/{model_name}/{model_version}/{rest}``, ``""`` for the shorter forms.
- ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``: OpenAI's API, in
  :mod:`inference_service.frontends.openai.api` (mounted here, answering OpenAI's error shape).

The request goes through the same worker path as gRPC: :meth:`InferenceCore.stream` for a
model with ``batchSize`` 1 (a batch of one) and for every continuous-batching
(``continuousBatching``) or async (``asyncCommunication``) model, whatever its ``batchSize``
(the stream runs beside the others, as TorchServe streams continuous batching over HTTP);
:meth:`InferenceCore.predict` (dynamic batching; intermediate responses concatenated, like
gRPC ``Predictions``) for a batch-mode model with a larger batch size. A handler that sends
intermediate responses gets a ``Transfer-Encoding: chunked`` answer, one chunk per
intermediate response and then the final one (an empty message sends no chunk); any other
answer is one body with a ``Content-Length``; :mod:`.streams` says what the chunks hold (raw, the
LLM's usage on its own line, NDJSON). The headers and the first chunk leave the moment
the first intermediate response arrives; every later chunk leaves the moment it is produced. An error
after the first chunk ends the connection without the terminating chunk, so the client sees
an incomplete body rather than a complete one. A client that disconnects cancels its request
in the worker, as a gRPC cancel does.

Token authorization (on unless ``disable_token_authorization``): every request, ``/ping``
included, carries ``Authorization: Bearer <inference key>`` from ``key_file.json``, as
TorchServe's; otherwise 401 with TorchServe's message (TorchServe answers 400).

Errors answer TorchServe's JSON body ``{"code": 404, "type": "ModelNotFoundException",
"message": "..."}`` with the status of :func:`http_status` (plus ``Retry-After`` where a retry
can succeed). Bodies above ``max_request_size`` bytes are refused with 413, as TorchServe's
HTTP server does.

Quick start::

    api = HttpInferenceApi(core, keys=auth.keys, max_request_size=6553500)
    port = await api.start("127.0.0.1", 0)   # the bound port
    ...
    await api.stop()
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from inference_service.config import Settings
from inference_service.errors import InferenceError, InvalidArgument
from inference_service.frontends.http.access import install_access_log
from inference_service.frontends.http.connections import ConnectionGuard, GuardedSite
from inference_service.frontends.http.limits import PartCounter, form_fields
from inference_service.frontends.http.streams import StreamFraming, usage_object, wants_ndjson
from inference_service.frontends.oip.http import add_open_inference_routes
from inference_service.frontends.openai.mount import add_openai_routes, is_openai_path, unauthorized_response
from inference_service.frontends.request_ids import handler_headers
from inference_service.observability.accesslog import AccessLog
from inference_service.security.auth import INFERENCE, KeyStore, read_bearer
from inference_service.security.exposure import warn_exposed_binds
from inference_service.serving.core import InferenceCore

log = logging.getLogger("inference_service.http")

# gRPC status code of an InferenceError -> HTTP status (TorchServe's statuses where it has one).
_HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 507,
}
# Reasons whose HTTP status differs from their gRPC code's.
_REASON_STATUS = {"REQUEST_TOO_LARGE": 413, "JOB_QUEUE_FULL": 503}
# TorchServe's error "type" (its exception class names) per status.
_ERROR_TYPE = {
    400: "BadRequestException",
    401: "InvalidKeyException",
    404: "ModelNotFoundException",
    405: "MethodNotAllowedException",
    413: "RequestEntityTooLargeException",
    503: "ServiceUnavailableException",
}
TOKEN_MESSAGE = "Token Authorization failed. Token either incorrect, expired, or not provided correctly"
NOT_FOUND_MESSAGE = "Requested resource is not found, please refer to API document."
#: A client that closed its connection before its whole body (Content-Length) arrived: 400, no traceback.
CLIENT_GONE_MESSAGE = "the connection closed before the whole request body arrived"
_FORM = "application/x-www-form-urlencoded"


def http_status(exc: InferenceError) -> int:
    """The HTTP status of an :class:`InferenceError` on the HTTP API.

    A status the handler set (4xx/5xx) is answered as is, as TorchServe's REST API does.
    Otherwise, as TorchServe's: 400 bad request, 404 unknown model or version, 503 no worker /
    shutting down / job queue full, 507 a response above ``max_response_size``, 413 a request above
    ``max_request_size``, 500 a handler error. Added here: 504 when the model's
    ``response_timeout`` passed (TorchServe answers 500 "Worker died."), 401/403/409/501 for
    the matching gRPC codes.
    """
    if exc.http_status is not None and 400 <= exc.http_status <= 599:
        return exc.http_status  # the handler's own status, as TorchServe's REST API answers it
    return _REASON_STATUS.get(exc.reason) or _HTTP_STATUS.get(exc.code, 500)


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   error_type: str | None = None) -> web.Response:
    """TorchServe's JSON error body ``{"code", "type", "message"}`` with ``status``."""
    body = {"code": status, "type": error_type or _ERROR_TYPE.get(status, "InternalServerException"),
            "message": message}
    return web.json_response(body, status=status, headers=headers, dumps=lambda d: json.dumps(d, indent=2))


def _inference_error_response(exc: InferenceError) -> web.Response:
    status = http_status(exc)
    headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if exc.retry_after_s is not None else None
    return error_response(status, exc.message, headers)


def server_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The HTTP API's TLS context: ``None`` (plaintext) unless ``inference_address`` is ``https://``.

    As TorchServe, HTTPS uses ``certificate_file`` / ``private_key_file``; ``client_ca_file``
    also requires clients to present a certificate it signed (mutual TLS, an addition).

    Raises:
        OSError: HTTPS without a certificate or key, or a file that cannot be read or is not
            a PEM certificate / key (the message names it).
    """
    if not settings.http_tls:
        return None
    if settings.certificate_file is None or settings.private_key_file is None:
        raise OSError("an https:// inference_address needs certificate_file and private_key_file")
    return tls_context(settings.certificate_file, settings.private_key_file, settings.client_ca_file)


def tls_context(certificate_file: Path, private_key_file: Path, client_ca_file: Path | None) -> ssl.SSLContext:
    """A server TLS context from PEM files; with ``client_ca_file``, clients must present a certificate it signed.

    Raises:
        OSError: a file cannot be read or is not a PEM certificate / key (the message names it).
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certificate_file, private_key_file)
        if client_ca_file is not None:
            context.load_verify_locations(cafile=client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise OSError(f"cannot load the HTTPS certificate_file {certificate_file} / private_key_file "
                      f"{private_key_file}{f' / client_ca_file {client_ca_file}' if client_ca_file else ''}: "
                      f"{exc}") from exc
    return context


async def serve_app(app: web.Application, api: str, address: str, port: int, *,
                    ssl_context: ssl.SSLContext | None, shutdown_timeout_s: float,
                    handler_cancellation: bool = False,
                    guard: ConnectionGuard | None = None) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``address:port`` (0: a free port); returns its runner and the bound port.

    Requests are not access-logged one by one; open responses get ``shutdown_timeout_s`` at
    ``runner.cleanup()``. With ``guard`` its connections are capped and held to its deadlines
    (aiohttp's keep-alive timeout: ``idle_timeout_s``; see :mod:`.connections`).

    Raises:
        OSError: the address cannot be bound ("cannot bind the <api> to <address>:<port>: ...").
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        sock = socket.create_server((address, port), family=family, reuse_port=False, backlog=1024)
    except OSError as exc:
        raise OSError(f"cannot bind the {api} to {address}:{port}: {exc.strerror or exc}") from exc
    extra: dict[str, Any] = {} if guard is None else {"keepalive_timeout": guard.limits.idle_timeout_s}
    if guard is not None:
        app.middlewares.insert(0, guard.middleware)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=handler_cancellation,
                           shutdown_timeout=shutdown_timeout_s, **extra)
    await runner.setup()
    if guard is None:
        await web.SockSite(runner, sock, ssl_context=ssl_context, shutdown_timeout=shutdown_timeout_s).start()
    else:
        await GuardedSite(runner, sock, guard, ssl_context=ssl_context, shutdown_timeout=shutdown_timeout_s,
                          backlog=1024).start()
    return runner, int(sock.getsockname()[1])


class HttpInferenceApi:
    """TorchServe's HTTP/1.1 inference API (``/ping``, ``/predictions``) on an aiohttp server.

    Args:
        core: the serving core shared with the gRPC servicers.
        keys: the token key store (``None``: token authorization off).
        max_request_size: largest request body in bytes (``max_request_size``, default 6553500).
        ssl_context: serve HTTPS with this context (``None``: plaintext).
        shutdown_timeout_s: at :meth:`stop`, how long open responses may finish before their
            connections are closed (the server drains in-flight work before calling it).
        access_log: where each request gets its line (``None``: nowhere; see :mod:`.access`).
    """

    def __init__(self, core: InferenceCore, *, keys: KeyStore | None, max_request_size: int,
                 ssl_context: ssl.SSLContext | None = None, shutdown_timeout_s: float = 1.0,
                 access_log: AccessLog | None = None) -> None:
        self.core = core
        self.keys = keys
        self.max_request_size = max_request_size
        self.ssl_context = ssl_context
        self.shutdown_timeout_s = shutdown_timeout_s
        self.app = web.Application(client_max_size=max_request_size,
                                   middlewares=[self._errors_middleware, self._auth_middleware])
        self.app.router.add_get("/ping", self.ping, allow_head=False)
        for path in ("/predictions/{model_name}", "/predictions/{model_name}/{model_version}",
                     "/predictions/{model_name}/{model_version}/{url_path:.+}"):
            self.app.router.add_post(path, self.predictions)
            self.app.router.add_put(path, self.predictions)
        add_openai_routes(self.app, core, http_status=http_status)  # /v1: OpenAI's API (openai_mount.py)
        add_open_inference_routes(self.app, core)  # /v2: KServe v2 (http_open_inference.py)
        install_access_log(self.app, access_log)  # one line per request, /v1 and /v2 included
        self._runner: web.AppRunner | None = None
        self.connection_guard: ConnectionGuard | None = None  # set before start (server.py)

    async def start(self, address: str, port: int) -> int:
        """Bind ``address:port`` (0: a free port) and serve; returns the bound port.

        Raises:
            OSError: the address cannot be bound (the message names it).
        """
        # handler_cancellation: a client that disconnects cancels its handler, and so its request
        # in the worker
        self._runner, bound = await serve_app(self.app, "HTTP inference API", address, port,
                                              ssl_context=self.ssl_context, shutdown_timeout_s=self.shutdown_timeout_s,
                                              handler_cancellation=True, guard=self.connection_guard)
        warn_exposed_binds({"HTTP inference": address}, self.keys is not None, self.ssl_context is not None,
                           tls_hint="use an https:// inference_address")
        return bound

    async def stop(self) -> None:
        """Stop listening and close connections (open responses get ``shutdown_timeout_s``)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ------------------------------------------------------------ middlewares
    @web.middleware
    async def _errors_middleware(self, request: web.Request,
                                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Answer every failure with TorchServe's JSON error body."""
        try:
            return await handler(request)
        except InferenceError as exc:
            return _inference_error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body exceeds max_request_size={self.max_request_size} bytes")
        except web.HTTPMethodNotAllowed as exc:
            return error_response(405, f"method {request.method} is not allowed on {request.path}",
                                  headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
        except web.HTTPNotFound:
            return error_response(404, NOT_FOUND_MESSAGE, error_type="ResourceNotFoundException")
        except web.HTTPException as exc:
            return error_response(exc.status, exc.reason)
        except ConnectionResetError:  # aiohttp's "Connection lost" while the body was being read
            log.info("HTTP %s %s: %s", request.method, request.path, CLIENT_GONE_MESSAGE)
            return error_response(400, CLIENT_GONE_MESSAGE)
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return error_response(500, "Internal server error")

    @web.middleware
    async def _auth_middleware(self, request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Refuse requests without ``Authorization: Bearer <inference key>`` (401) when authorization is on."""
        if self.keys is not None and not self.keys.verify(INFERENCE, read_bearer(request.headers.items())):
            log.info("rejected HTTP %s %s: %s token", request.method, request.path,
                     "missing" if "Authorization" not in request.headers else "invalid")
            if is_openai_path(request.path):
                return unauthorized_response(request)  # OpenAI's error shape for OpenAI's clients
            return error_response(401, TOKEN_MESSAGE, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # --------------------------------------------------------------- routes
    async def ping(self, request: web.Request) -> web.Response:
        """``GET /ping``: TorchServe's ``{"status": "Healthy"}`` (200) or ``{"status": "Unhealthy"}`` (500)."""
        healthy = self.core.healthy()
        return web.json_response({"status": "Healthy" if healthy else "Unhealthy"}, status=200 if healthy else 500,
                                 dumps=lambda d: json.dumps(d, indent=2))

    async def predictions(self, request: web.Request) -> web.StreamResponse:
        """``POST /predictions/{model_name}[/{model_version}[/{url_path}]]``: run the model on the request.

        Whatever follows the version (``/predictions/llm/1.0/v1/chat/completions``) reaches the
        handler as the request header ``url_path`` (``v1/chat/completions``; ``""`` for the shorter
        forms, replacing a client's own ``url_path`` header), as TorchServe 0.12 passes it (its vLLM
        handler routes on it).

        Steps: 1. resolve the model (404 when unknown); 2. read the body into the input map
        (413 above ``max_request_size``); 3. run it on the core, streamed for batch size 1 and
        continuous / async workers, batched otherwise (see the module docstring for the response forms).
        """
        name = request.match_info["model_name"]
        version = request.match_info.get("model_version", "")
        model = self.core.get(name, version)
        inputs = await self._inputs(request)
        headers = handler_headers(request.headers.items(), request["request_id"])
        headers["url_path"] = request.match_info.get("url_path", "")  # as TorchServe: "" for the shorter forms
        if model.config.batch_size > 1 and not model.config.streams_in_batches:
            # batch mode: a stream would be a batch of one, so the request is batched dynamically
            return web.Response(body=await self.core.predict(name, version, inputs, headers))
        return await self._stream(request, self.core.stream(name, version, inputs, headers))

    async def _inputs(self, request: web.Request) -> dict[str, bytes]:
        """The input map, as TorchServe builds it: form fields by name, else the raw body as ``body``.

        Raises:
            InvalidArgument: (400) more than ``max_request_parts`` parts or form fields, a
                malformed multipart body.
            web.HTTPRequestEntityTooLarge: (413) a body above ``max_request_size``.
        """
        declared = request.content_length
        if declared is not None and declared > self.max_request_size:
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_request_size, actual_size=declared)
        if request.content_type.startswith("multipart/"):
            return await self._multipart(request)
        if request.content_type == _FORM:
            return await form_fields(request, self.core.settings.max_request_parts)
        return {"body": await request.read()}

    async def _multipart(self, request: web.Request) -> dict[str, bytes]:
        """The parts of a ``multipart/*`` body by name (``body`` for an unnamed part).

        At most ``max_request_parts`` parts are read; the loop is handed back every
        :data:`~inference_service.frontends.http.limits.PARTS_PER_TURN` parts.

        Raises:
            InvalidArgument: (400) a nested multipart, more than ``max_request_parts`` parts, or a
                body that does not parse as multipart (no or wrong boundary, truncated, bad part
                headers): "malformed multipart body: ...".
            web.HTTPRequestEntityTooLarge: (413) the parts exceed ``max_request_size`` bytes.
        """
        inputs: dict[str, bytes] = {}
        total = 0
        parts = PartCounter(self.core.settings.max_request_parts)
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                await parts.next()
                if not isinstance(part, BodyPartReader):  # a nested multipart: not something TorchServe reads
                    raise InvalidArgument("nested multipart bodies are not supported")
                data = bytearray()
                while chunk := await part.read_chunk():
                    total += len(chunk)
                    if total > self.max_request_size:
                        raise web.HTTPRequestEntityTooLarge(max_size=self.max_request_size, actual_size=total)
                    data += chunk
                inputs[part.name or "body"] = bytes(data)
        except (ValueError, AssertionError, LookupError, HttpProcessingError) as exc:
            # aiohttp's multipart reader raises these for bodies that break the format
            raise InvalidArgument(f"malformed multipart body: {exc or type(exc).__name__}") from exc
        return inputs

    async def _stream(self, request: web.Request,
                      messages: AsyncIterator[tuple[bytes, bool]]) -> web.StreamResponse:
        """One body for a single message; chunked transfer, a chunk per message, for several.

        The first chunk leaves as soon as the handler sends its first intermediate response.
        The bytes written follow :class:`~inference_service.frontends.http.streams.StreamFraming`
        (raw, or NDJSON for ``Accept: application/x-ndjson``).
        """
        framing = StreamFraming(wants_ndjson(request.headers.get("Accept", "")))
        async with contextlib.aclosing(messages):  # type: ignore[type-var]
            first = await anext(messages, None)
            if first is None:  # pragma: no cover - the core always ends with a final message
                return web.Response(body=b"")
            if first[1]:
                if not framing.ndjson and usage_object(first[0]) is None:
                    return web.Response(body=first[0])  # a whole answer, as TorchServe's
                content_type = framing.content_type(first[0])
                return web.Response(body=framing.final(first[0]),
                                    headers={"Content-Type": content_type} if content_type else None)
            response = web.StreamResponse()
            content_type = framing.content_type(first[0])
            if content_type is not None:
                response.headers["Content-Type"] = content_type
            response.enable_chunked_encoding()
            await response.prepare(request)
            try:
                if data := framing.piece(first[0]):
                    await response.write(data)
                async for payload, final in messages:
                    data = framing.final(payload) if final else framing.piece(payload)
                    if data:
                        await response.write(data)
            except InferenceError as exc:
                # The status line is gone already: end the connection without the terminating chunk.
                log.warning("HTTP stream of %s failed after its first chunk: %s", request.path, exc.message)
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
            return response
