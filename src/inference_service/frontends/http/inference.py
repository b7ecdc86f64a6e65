"""TorchServe's HTTP/1.1 inference API, over the same :class:`~inference_service.serving.core.InferenceCore`.

Served by aiohttp in the server's asyncio loop, beside the gRPC servers; OpenAI's ``/v1`` and
KServe's ``/v2`` routes are mounted on the same app. A model with ``batchSize`` 1, continuous
batching or async workers is streamed (chunked, a chunk per intermediate response); a batch-mode
model is batched dynamically and answers one body. Routes, errors and the stream framing: see
docs/apis.md and docs/clients.md.

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
from inference_service.contracts.explain import set_explain
from inference_service.errors import InferenceError, InvalidArgument
from inference_service.frontends.anthropic.mount import add_anthropic_routes, is_anthropic_path
from inference_service.frontends.anthropic.mount import unauthorized_response as anthropic_unauthorized
from inference_service.frontends.http.access import install_access_log
from inference_service.frontends.http.connections import ConnectionGuard, GuardedSite
from inference_service.frontends.http.limits import PartCounter, form_fields
from inference_service.frontends.http.sleep import SLEEP_PATHS, add_sleep_routes
from inference_service.frontends.http.streams import StreamFraming, passed_headers, usage_object, wants_ndjson
from inference_service.frontends.oip.http import add_open_inference_routes
from inference_service.frontends.openai.mount import add_openai_routes, is_openai_path, unauthorized_response
from inference_service.frontends.request_ids import handler_headers
from inference_service.observability.accesslog import AccessLog
from inference_service.security.auth import INFERENCE, MANAGEMENT, KeyStore, read_bearer
from inference_service.security.exposure import warn_exposed_binds
from inference_service.serving.core import InferenceCore
from inference_service.serving.sequences import SEQ_END, SEQ_ID

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
# Reasons whose HTTP status differs from their gRPC code's (TorchServe's ConflictStatusException and
# InvalidModelVersionException for the last two).
_REASON_STATUS = {"REQUEST_TOO_LARGE": 413, "JOB_QUEUE_FULL": 503, "VERSION_REGISTERED": 409, "DEFAULT_VERSION": 403}
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
    """The HTTP status of an :class:`InferenceError`: the handler's own 4xx/5xx as is (as TorchServe's
    REST API), else TorchServe's status; 504 for ``response_timeout`` (TorchServe: 500 "Worker died.")."""
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


def server_ssl_context(settings: Settings, key: str = "inference_address") -> ssl.SSLContext | None:
    """The TLS context of the HTTP API whose address is ``key`` (``inference_address`` or
    ``metrics_address``, whose metrics API shares the certificate): ``None`` (plaintext) unless
    that address is ``https://``.

    Raises:
        OSError: HTTPS without a certificate or key, or a file that is not a readable PEM one.
    """
    if not (settings.metrics_tls if key == "metrics_address" else settings.http_tls):
        return None
    if settings.certificate_file is None or settings.private_key_file is None:
        raise OSError(f"an https:// {key} needs certificate_file and private_key_file")
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

    Raises:
        OSError: the address cannot be bound (the message names it).
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
        keys: the token key store (``None``: token authorization off).
        max_request_size: largest request body in bytes.
        shutdown_timeout_s: at :meth:`stop`, how long open responses may finish.
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
        self.app.router.add_post("/v1/models/{model_name}:predict", self.kserve_v1_predict)
        for path in ("/explanations/{model_name}", "/explanations/{model_name}/{model_version}",
                     "/explanations/{model_name}/{model_version}/{url_path:.+}"):
            self.app.router.add_post(path, self.explanations)
            self.app.router.add_put(path, self.explanations)
        self.app.router.add_post("/v1/models/{model_name}:explain", self.kserve_v1_explain)
        openai_api = add_openai_routes(self.app, core, http_status=http_status)  # /v1: OpenAI's API (mount.py)
        add_anthropic_routes(self.app, openai_api)  # /v1/messages: Anthropic's API (frontends/anthropic)
        add_open_inference_routes(self.app, core)  # /v2: KServe v2 (http_open_inference.py)
        add_sleep_routes(self.app, core)  # vLLM's /sleep, /wake_up, /is_sleeping (management key)
        install_access_log(self.app, access_log,  # one line per request, /v1 and /v2 included
                           core.telemetry.http_response if core.telemetry is not None else None)
        self._runner: web.AppRunner | None = None
        self.connection_guard: ConnectionGuard | None = None  # set before start (server.py)

    async def start(self, address: str, port: int) -> int:
        """Bind ``address:port`` (0: a free port) and serve; returns the bound port; OSError if it cannot."""
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
        """Refuse requests without ``Authorization: Bearer <inference key>`` (401) when authorization is on;
        the sleep routes need the management key."""
        if self.keys is None:
            return await handler(request)
        token = read_bearer(request.headers.items())
        anthropic = is_anthropic_path(request.path)
        if token is None and anthropic:  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key")
        if not self.keys.verify(MANAGEMENT if request.path in SLEEP_PATHS else INFERENCE, token):
            log.info("rejected HTTP %s %s: %s token", request.method, request.path,
                     "missing" if token is None else "invalid")
            if anthropic:
                return await anthropic_unauthorized(request)
            if is_openai_path(request.path):
                return await unauthorized_response(request)  # OpenAI's error shape for OpenAI's clients
            return error_response(401, TOKEN_MESSAGE, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # --------------------------------------------------------------- routes
    async def ping(self, request: web.Request) -> web.Response:
        """``GET /ping``: TorchServe's ``{"status": "Healthy"}`` (200) or ``{"status": "Unhealthy"}`` (500)."""
        healthy = self.core.healthy()
        return web.json_response({"status": "Healthy" if healthy else "Unhealthy"}, status=200 if healthy else 500,
                                 dumps=lambda d: json.dumps(d, indent=2))

    async def predictions(self, request: web.Request) -> web.StreamResponse:
        """``POST /predictions/{model_name}[/{model_version}[/{url_path}]]``: 404 unknown model, 413 too large.

        Whatever follows the version reaches the handler as the header ``url_path``, as TorchServe 0.12.
        """
        name = request.match_info["model_name"]
        version = request.match_info.get("model_version", "")
        model = self.core.get(name, version)
        inputs, content_types = await self._inputs(request)
        headers = handler_headers(request.headers.items(), request["request_id"])
        headers["url_path"] = request.match_info.get("url_path", "")  # as TorchServe: "" for the shorter forms
        set_explain(headers, request.get("explain", False))
        reply: dict[str, str] = {}  # the handler's response headers, as they arrive
        seq = None
        if model.config.sequence_batching:  # a sequence held between requests (serving/sequences.py)
            seq = model.enter_held(request.headers.get(SEQ_ID) or None, headers)
            reply[SEQ_ID] = seq
        try:
            if model.config.batch_size > 1 and not model.config.streams_in_batches:
                # batch mode: a stream would be a batch of one, so the request is batched dynamically
                body = await self.core.predict(name, model.version, inputs, headers, content_types=content_types,
                                               sequence_id=seq, response_headers=reply)
                return web.Response(body=body, headers=passed_headers(reply))
            return await self._stream(request, self.core.stream(name, model.version, inputs, headers, sequence_id=seq,
                                                                content_types=content_types,
                                                                response_headers=reply), reply)
        finally:
            if seq is not None:
                model.leave_held(seq, request.headers.get(SEQ_END, "").lower() == "true", reply)

    async def kserve_v1_predict(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/models/{model_name}:predict``, KServe v1 as TorchServe serves it: the body is the
        input ``body`` whatever its Content-Type (KServe's sample curl sends it as a form), as bytes."""
        request["raw_body"] = True
        return await self.predictions(request)

    async def explanations(self, request: web.Request) -> web.StreamResponse:
        """``POST /explanations/{model_name}[/{model_version}[/{url_path}]]``: :meth:`predictions` with
        the header ``explain: True`` (TorchServe's), so that ``BaseHandler`` answers ``explain_handle``."""
        request["explain"] = True
        return await self.predictions(request)

    async def kserve_v1_explain(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/models/{model_name}:explain``: :meth:`kserve_v1_predict` flagged as :meth:`explanations`."""
        request["explain"] = True
        return await self.kserve_v1_predict(request)

    async def _inputs(self, request: web.Request) -> tuple[dict[str, bytes], dict[str, str]]:
        """The input map and its inputs' content types, as TorchServe 0.12's ``InferenceRequestHandler``
        builds them: a form's fields by name (no content type, but a multipart file's), else the
        raw body as ``body`` with the request's media type (``Content-Type`` before any ``;``)."""
        declared = request.content_length
        if declared is not None and declared > self.max_request_size:
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_request_size, actual_size=declared)
        if request.get("raw_body"):
            return {"body": await request.read()}, {}
        if request.content_type == "multipart/form-data":  # only this one, as Netty's isMultipart
            return await self._multipart(request)
        if request.content_type == _FORM:
            return await form_fields(request, self.core.settings.max_request_parts), {}
        media_type = request.headers.get("Content-Type", "").split(";", 1)[0]
        return {"body": await request.read()}, {"body": media_type} if media_type else {}

    async def _multipart(self, request: web.Request) -> tuple[dict[str, bytes], dict[str, str]]:
        """The parts of a ``multipart/form-data`` body by name (``body`` for an unnamed part) and the content
        types of its files (parts with a ``filename``: their media type, ``application/octet-stream``
        when they name none, as Netty's ``FileUpload``); 400 if malformed."""
        inputs: dict[str, bytes] = {}
        content_types: dict[str, str] = {}
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
                name = part.name or "body"
                inputs[name] = bytes(data)
                if part.filename is not None:
                    media_type = part.headers.get("Content-Type", "").split(";", 1)[0].strip()
                    content_types[name] = media_type or "application/octet-stream"
                else:
                    content_types.pop(name, None)  # a field: no content type, as Netty's Attribute
        except (ValueError, AssertionError, LookupError, HttpProcessingError) as exc:
            # aiohttp's multipart reader raises these for bodies that break the format
            raise InvalidArgument(f"malformed multipart body: {exc or type(exc).__name__}") from exc
        return inputs, content_types

    async def _stream(self, request: web.Request, messages: AsyncIterator[tuple[bytes, bool]],
                      reply: dict[str, str] | None = None) -> web.StreamResponse:
        """One body for a single message; chunked transfer, a chunk per message, for several. The
        handler's response headers in ``reply`` (as of the first message) go on the answer."""
        framing = StreamFraming(wants_ndjson(request.headers.get("Accept", "")))
        async with contextlib.aclosing(messages):  # type: ignore[type-var]
            first = await anext(messages, None)
            if first is None:  # pragma: no cover - the core always ends with a final message
                return web.Response(body=b"")
            extra = passed_headers(reply or {})
            if first[1]:
                if not framing.ndjson and usage_object(first[0]) is None:
                    return web.Response(body=first[0], headers=extra)  # a whole answer, as TorchServe's
                content_type = framing.content_type(first[0])
                return web.Response(body=framing.final(first[0]),
                                    headers={"Content-Type": content_type, **extra} if content_type else extra)
            response = web.StreamResponse()
            content_type = framing.content_type(first[0])
            if content_type is not None:
                response.headers["Content-Type"] = content_type
            response.headers.update(extra)
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
