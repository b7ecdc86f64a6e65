"""TorchServe's HTTP/1.1 management API (port 8081), over the same
:class:`~inference_service.serving.core.InferenceCore` as the gRPC management servicer.

Each route reads TorchServe's query parameters, makes the one core call the gRPC servicer makes
for the same RPC, and answers with TorchServe 0.12's status code and JSON body (its
``ManagementRequestHandler``, ``ApiUtils`` and ``TokenAuthorizationHandler``). Without
``--enable-model-api``, ``POST /models`` and ``DELETE`` answer 405 as TorchServe's REST API does.
With ``http_management_status_codes=torchserve`` refusals carry TorchServe's status where this
server's differs (:func:`~inference_service.contracts.torchserve_status.torchserve_http_status`).
See docs/apis.md and docs/security.md.
"""

from __future__ import annotations

import json
import logging
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from inference_service.config import Settings
from inference_service.contracts.torchserve_status import HTTP_TOKEN_REFUSAL, TORCHSERVE, torchserve_http_status
from inference_service.errors import FailedPrecondition, InferenceError, InvalidArgument
from inference_service.frontends.http.access import install_access_log
from inference_service.frontends.http.connections import ConnectionGuard
from inference_service.frontends.http.inference import (
    CLIENT_GONE_MESSAGE,
    NOT_FOUND_MESSAGE,
    TOKEN_MESSAGE,
    error_response,
    http_status,
    serve_app,
    tls_context,
)
from inference_service.frontends.http.sleep import add_sleep_routes
from inference_service.frontends.limits import off_loop, parse_json
from inference_service.frontends.torchserve_json import (
    PROCESSING,
    describe_json,
    register_status,
    scale_status,
    unregister_status,
)
from inference_service.observability.accesslog import AccessLog
from inference_service.security.auth import (
    API,
    INFERENCE,
    MANAGEMENT,
    TokenAuthorization,
    read_bearer,
)
from inference_service.security.exposure import warn_exposed_binds
from inference_service.serving.core import InferenceCore
from inference_service.serving.registration import RegisterRequest

log = logging.getLogger("inference_service.http_management")

#: TorchServe's text for a method a path does not serve (its MethodNotAllowedException).
METHOD_NOT_ALLOWED_MESSAGE = "Requested method is not allowed, please refer to API document."
#: Added to that text when ``POST /models`` or ``DELETE`` is refused because the model API is off.
MODEL_API_DISABLED = "Model API disabled: start the server with --enable-model-api"
_MODEL_API_METHODS = frozenset({"POST", "DELETE"})
_INTEGER = re.compile(r"[+-]?[0-9]+")
_INT32 = range(-(2**31), 2**31)
# TorchServe's error "type" (its exception class names) for statuses the HTTP inference API does not answer.
_ERROR_TYPE = {403: "ForbiddenException", 409: "ConflictStatusException"}
# ... and for a reason whose class is not its status's: the default version while others exist.
_REASON_TYPE = {"DEFAULT_VERSION": "InvalidModelVersionException"}
#: The application's key of ``max_json_depth`` (set from the core's settings).
MAX_JSON_DEPTH = web.AppKey("max_json_depth", int)
MAX_JSON_NODES = web.AppKey("max_json_nodes", int)
#: ``http_management_status_codes``: ``"torchserve"`` answers TorchServe's statuses.
STATUS_CODES = web.AppKey("status_codes", str)
_PARAMETERS = "inference_service.parameters"  # a request's key: RegisterModel's parameters, once read
_REGISTER_FIELDS = ("batch_size", "max_batch_delay", "initial_workers", "response_timeout", "startup_timeout")


def integer(params: Mapping[str, str], key: str, default: int = 0, lenient: bool = False) -> int:
    """The integer query parameter ``key`` (``default`` when absent).

    Raises:
        InvalidArgument: not a 32-bit integer, unless ``lenient`` (TorchServe's codes): then the
            default, as TorchServe's ``NettyUtils.getIntParameter`` takes it.
    """
    value = params.get(key)
    if value is None or not value.strip():  # an empty value (a form's unset field) is absent, as on TorchServe
        return default
    if _INTEGER.fullmatch(value.strip()) is None or int(value) not in _INT32:
        if lenient:
            return default
        raise InvalidArgument(f"parameter {key} must be an integer, got {value!r}")
    return int(value)


def boolean(params: Mapping[str, str], key: str, default: bool, lenient: bool = False) -> bool:
    """The boolean query parameter ``key``: ``true`` or ``false`` in any case (``default`` when absent).

    Raises:
        InvalidArgument: anything else, unless ``lenient`` (TorchServe's codes): then false, as
            TorchServe's ``Boolean.parseBoolean`` reads it.
    """
    value = params.get(key)
    if value is None:
        return default
    if value.strip().lower() not in ("true", "false"):
        if lenient:
            return False
        raise InvalidArgument(f"parameter {key} must be true or false, got {value!r}")
    return value.strip().lower() == "true"


def json_response(body: str, status: int = 200) -> web.Response:
    """``body`` (JSON text) with ``status``, ending with a newline as TorchServe's answers do."""
    return web.Response(text=body + "\n", status=status, content_type="application/json")


def status_response(text: str, status: int = 200) -> web.Response:
    """TorchServe's ``{"status": "..."}`` body (its ``StatusResponse``), indented as it prints it."""
    return json_response(json.dumps({"status": text}, indent=2), status)


def management_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """``None`` (plaintext) unless ``management_address`` is ``https://``; then as the HTTP inference API.

    Raises:
        OSError: HTTPS without a certificate or key, or a file that is not a readable PEM file.
    """
    if not settings.http_management_tls:
        return None
    if settings.certificate_file is None or settings.private_key_file is None:
        raise OSError("an https:// management_address needs certificate_file and private_key_file")
    return tls_context(settings.certificate_file, settings.private_key_file, settings.client_ca_file)


class HttpManagementApi:
    """TorchServe's HTTP/1.1 management API (``/models``, ``/token``) on an aiohttp server::

        api = HttpManagementApi(core, auth=token_authorization, model_api_enabled=True)
        port = await api.start("127.0.0.1", 0)   # the bound port
        ...
        await api.stop()

    ``auth`` ``None``: off, and no ``/token`` route; ``shutdown_timeout_s``: how long open
    responses may finish at :meth:`stop`; ``status_codes``: ``http_management_status_codes``.
    """

    def __init__(self, core: InferenceCore, *, auth: TokenAuthorization | None, model_api_enabled: bool,
                 max_request_size: int = 6_553_500, ssl_context: ssl.SSLContext | None = None,
                 shutdown_timeout_s: float = 1.0, access_log: AccessLog | None = None,
                 status_codes: str = "default") -> None:
        self.core = core
        self.auth = auth
        self.model_api_enabled = model_api_enabled
        self.ssl_context = ssl_context
        self.shutdown_timeout_s = shutdown_timeout_s
        self.torchserve_codes = status_codes == TORCHSERVE
        self.app = web.Application(client_max_size=max_request_size,
                                   middlewares=[_answer_errors, self._auth_middleware])
        self.app[MAX_JSON_DEPTH] = core.settings.max_json_depth
        self.app[MAX_JSON_NODES] = core.settings.max_json_nodes
        self.app[STATUS_CODES] = status_codes
        router = self.app.router
        for slash in ("", "/"):  # a trailing slash names the same resource (TorchServe ignores empty segments)
            router.add_get("/models" + slash, self.list_models, allow_head=False)
            router.add_post("/models" + slash, self.register)
            for path in ("/models/{model_name}", "/models/{model_name}/{model_version}"):
                router.add_get(path + slash, self.describe, allow_head=False)
                router.add_put(path + slash, self.scale)
                router.add_delete(path + slash, self.unregister)
            router.add_put("/models/{model_name}/{model_version}/set-default" + slash, self.set_default)
        add_sleep_routes(self.app, core)  # vLLM's /sleep, /wake_up, /is_sleeping
        if auth is not None:
            router.add_route("*", "/token", self.token)
        install_access_log(self.app, access_log, core.telemetry.http_response if core.telemetry is not None else None)
        self._runner: web.AppRunner | None = None
        self.connection_guard: ConnectionGuard | None = None  # set before start (server.py)

    async def start(self, address: str, port: int) -> int:
        """Bind ``address:port`` (0: a free port) and serve; returns the bound port.

        Raises:
            OSError: the address cannot be bound (the message names it).
        """
        self._runner, bound = await serve_app(self.app, "HTTP management API", address, port,
                                              ssl_context=self.ssl_context, shutdown_timeout_s=self.shutdown_timeout_s,
                                              guard=self.connection_guard)
        warn_exposed_binds({"HTTP management": address}, self.auth is not None, self.ssl_context is not None,
                           tls_hint="use an https:// management_address")
        return bound

    async def stop(self) -> None:
        """Stop listening and close connections (open responses get ``shutdown_timeout_s``)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # ------------------------------------------------------------ middlewares
    @web.middleware
    async def _auth_middleware(self, request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Refuse requests without ``Authorization: Bearer <key>`` (401; TorchServe's codes: 400) when
        authorization is on: the management key, or the ``API`` key for ``/token`` (TorchServe's
        TokenAuthorizationHandler)."""
        if self.auth is not None:
            scope = API if request.path == "/token" else MANAGEMENT
            if not self.auth.keys.verify(scope, read_bearer(request.headers.items())):
                log.info("rejected HTTP %s %s: %s token", request.method, request.path,
                         "missing" if "Authorization" not in request.headers else "invalid")
                if self.torchserve_codes:
                    status, error_type = HTTP_TOKEN_REFUSAL
                    return error_response(status, TOKEN_MESSAGE, error_type=error_type)
                return error_response(401, TOKEN_MESSAGE, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    def _model_api_refusal(self, request: web.Request) -> web.Response | None:
        """TorchServe's 405 for ``POST /models`` and ``DELETE`` while the model API is disabled."""
        if self.model_api_enabled:
            return None
        served = {route.method for route in request.match_info.route.resource or ()} - _MODEL_API_METHODS
        return _method_not_allowed(served, MODEL_API_DISABLED)

    # --------------------------------------------------------------- routes
    async def register(self, request: web.Request) -> web.Response:
        """``POST /models``: RegisterModel. A version registered already is 409 (TorchServe's
        ConflictStatusException); other FAILED_PRECONDITION errors 400. ``startup_timeout=0`` is read
        as TorchServe's REST API reads it: no time to load (see ``prepare_version``)."""
        if (refusal := self._model_api_refusal(request)) is not None:
            return refusal
        params, synchronous_default = await _register_params(request)
        request[_PARAMETERS] = params
        lenient = self.torchserve_codes and synchronous_default  # the query form; a JSON body keeps types
        synchronous = boolean(params, "synchronous", synchronous_default, lenient)
        if self.torchserve_codes:
            _refuse_stored_download(self.core.settings, params.get("url", ""))
        req = RegisterRequest(url=params.get("url", ""), model_name=params.get("model_name", ""),
                              handler=params.get("handler", ""), runtime=params.get("runtime", ""),
                              synchronous=synchronous)
        for key in _REGISTER_FIELDS:
            setattr(req, key, integer(params, key, lenient=lenient))
        req.startup_timeout_zero = req.startup_timeout == 0 and bool(params.get("startup_timeout", "").strip())
        model = await self.core.register(req)
        status = register_status(model, synchronous)
        return status_response(status, 202 if status == PROCESSING else 200)

    async def list_models(self, request: web.Request) -> web.Response:
        """``GET /models?limit=&next_page_token=``: ListModels' JSON, names sorted."""
        query, lenient = request.query, self.torchserve_codes
        page = self.core.list_models(integer(query, "limit", lenient=lenient),
                                     integer(query, "next_page_token", lenient=lenient))
        return json_response(json.dumps(page, indent=2))

    async def describe(self, request: web.Request) -> web.Response:
        """``GET /models/{name}[/{version}|/all]``: DescribeModel's JSON array; ``customized=true`` gets
        the same (the handler's customized metadata is not asked for)."""
        boolean(request.query, "customized", False, self.torchserve_codes)
        name, version = _model(request)
        return json_response(describe_json(self.core.versions(name, version)))

    async def scale(self, request: web.Request) -> web.Response:
        """``PUT /models/{name}[/{version}]``: ScaleWorker (``model_version`` may also be a parameter);
        ``idle_timeout`` (seconds, 0: never) sets ``idleTimeoutSec``, alone or with a scale."""
        name, version = _model(request)
        query = request.query
        version = version or query.get("model_version", "")
        if "idle_timeout" in query:
            model = self.core.get(name, version)
            model.sleep.set_idle_timeout(_idle_timeout(query["idle_timeout"]))
            if "min_worker" not in query and "max_worker" not in query:
                return status_response(f"Idle timeout set to {model.config.idle_timeout_s:g} s for model: {name}")
        lenient = self.torchserve_codes
        min_worker = integer(query, "min_worker", 1, lenient)
        max_worker = integer(query, "max_worker", min_worker, lenient)
        synchronous = boolean(query, "synchronous", False, lenient)
        if self.torchserve_codes and min_worker <= max_worker < 0:
            self.core.get(name, version)  # TorchServe finds the model before its count fails (404 first)
        model = await self.core.scale(name, version, min_worker, max_worker,
                                      synchronous, integer(query, "timeout", lenient=lenient),
                                      integer(query, "number_gpu", lenient=lenient))
        status = scale_status(model, version, synchronous)
        return status_response(status, 202 if status == PROCESSING else 200)

    async def unregister(self, request: web.Request) -> web.Response:
        """``DELETE /models/{name}[/{version}]``: UnregisterModel (the default version when none is named)."""
        if (refusal := self._model_api_refusal(request)) is not None:
            return refusal
        name, version = _model(request)
        await self.core.unregister(name, version)
        return status_response(unregister_status(name))

    async def set_default(self, request: web.Request) -> web.Response:
        """``PUT /models/{name}/{version}/set-default``: SetDefault."""
        name, version = _model(request)
        self.core.set_default(name, version)
        return status_response(f'Default version successfully updated for model "{name}" to "{version}"')

    async def token(self, request: web.Request) -> web.Response:
        """``/token?type=management|inference``: a new key in ``key_file.json``; 400 for another type or
        a key the operator fixed, 500 when the key file cannot be written."""
        scope = request.query.get("type", "")
        if scope not in (MANAGEMENT, INFERENCE):
            raise InvalidArgument(f"parameter type must be {MANAGEMENT} or {INFERENCE}, got {scope!r}")
        assert self.auth is not None  # the route exists only with token authorization
        try:
            self.auth.renew(scope)
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None
        except OSError as exc:
            raise InferenceError(f"the {scope} key was renewed but {self.auth.key_file} could not be written: "
                                 f"{exc.strerror or exc}") from exc
        return status_response(f"{scope} key renewed: read it from {self.auth.key_file.name}")


@web.middleware
async def _answer_errors(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Answer every failure with TorchServe's JSON error body and status (the outer middleware)."""
    try:
        return await handler(request)
    except InferenceError as exc:
        status, error_type, retry_after = http_status(exc), None, exc.retry_after_s
        if request.app[STATUS_CODES] == TORCHSERVE:
            torchserve = torchserve_http_status(exc, request.get(_PARAMETERS, request.query))
            if torchserve is not None:
                (status, error_type), retry_after = torchserve, None
        error_type = error_type or _REASON_TYPE.get(exc.reason) or _ERROR_TYPE.get(status)
        retry = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
        return error_response(status, exc.message, retry, error_type)
    except web.HTTPException as exc:  # from routing: an unknown path or method, a body above the limit
        if isinstance(exc, web.HTTPMethodNotAllowed):
            return _method_not_allowed(exc.allowed_methods)
        not_found = exc.status == 404
        return error_response(exc.status, NOT_FOUND_MESSAGE if not_found else exc.reason,
                              error_type="ResourceNotFoundException" if not_found else None)
    except ConnectionResetError:  # aiohttp's "Connection lost" while the body was being read
        log.info("HTTP %s %s: %s", request.method, request.path, CLIENT_GONE_MESSAGE)
        return error_response(400, CLIENT_GONE_MESSAGE)
    except Exception:
        log.exception("HTTP %s %s failed", request.method, request.path)
        return error_response(500, "Internal server error")


def _idle_timeout(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 604_800:  # NaN too
        raise InvalidArgument(f"idle_timeout must be 0 (never) to 604800 seconds, got {text[:40]!r}")
    return seconds


def _refuse_stored_download(settings: Settings, url: str) -> None:
    """TorchServe's refusal of an allowed ``http(s)://`` URL whose file name is in the model store,
    made before it downloads anything (``ArchiveUtils.downloadArchive``): 500, "Model file already
    exists" (``MODEL_FILE_EXISTS``).

    Raises:
        InferenceError: that file is in the store (and the policy's refusals for a URL it refuses).
    """
    if settings.model_store is None or not url.lower().startswith(("http://", "https://")):
        return
    settings.url_policy.check(url)
    filename = urlsplit(url).path.rsplit("/", 1)[-1]
    if filename and (settings.model_store / filename).exists():
        raise InferenceError(f"Model file already exists {filename}", reason="MODEL_FILE_EXISTS")


def _model(request: web.Request) -> tuple[str, str]:
    """``(model name, version)`` of the path (version ``""``: the default)."""
    return request.match_info["model_name"], request.match_info.get("model_version", "")


def _method_not_allowed(allowed: set[str] | frozenset[str], hint: str = "") -> web.Response:
    """TorchServe's 405 body (its text, then ``hint``), with the ``Allow`` header HTTP asks for."""
    message = f"{METHOD_NOT_ALLOWED_MESSAGE} {hint}" if hint else METHOD_NOT_ALLOWED_MESSAGE
    return error_response(405, message, headers={"Allow": ", ".join(sorted(allowed))})


async def _register_params(request: web.Request) -> tuple[dict[str, str], bool]:
    """RegisterModel's parameters and ``synchronous``'s default: from an ``application/json`` body
    (false, TorchServe's Gson defaults), else the query (true, its ``RegisterModelRequest``).
    InvalidArgument for a JSON body that is not an object or passes the JSON bounds."""
    if request.content_type != "application/json":
        return dict(request.query), True
    raw = await request.read()
    body: Any = await off_loop(parse_json, raw, request.app[MAX_JSON_DEPTH], request.app[MAX_JSON_NODES],
                               size=len(raw))
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return {key: (str(value).lower() if isinstance(value, bool) else str(value))
            for key, value in body.items() if value is not None}, False
