"""One error hierarchy for the server, each class carrying its gRPC status code.

Core code raises these; :mod:`inference_service.frontends.grpc.base` maps them to
statuses in one place. Anything else that escapes becomes INTERNAL
"Internal server error" with the traceback in the log only.
"""

from __future__ import annotations

import grpc

MAX_ECHOED = 300
"""Characters of a client's value (a name, a URL) quoted in an error message at most."""
MAX_MESSAGE = 4000
"""Characters of an error message at most, whatever it quotes (gRPC carries it in a header)."""


def shorten(text: str, limit: int = MAX_ECHOED) -> str:
    """``text``, cut to ``limit`` characters with "..." when longer: error messages quote what
    the client sent, and a 20,000-character model name would push the status past the 8 KiB
    header size clients accept."""
    return text if len(text) <= limit else text[:limit] + "..."


class InferenceError(Exception):
    """Base of every error a client may see.

    Failing RPCs carry, besides the status code and message, a ``google.rpc.Status``
    with an ``ErrorInfo`` (domain ``inference-service``, a stable ``reason``, the model
    name and version) and, where a retry can succeed, a ``RetryInfo``.

    Args:
        message: what went wrong, in words a user can act on (cut to :data:`MAX_MESSAGE`).
        reason: stable machine-readable reason (default: the class's).
        retry_after_s: suggested retry delay in seconds (``None``: retrying will not help).
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"
    retry_after_s: float | None = None
    http_status: int | None = None  # the HTTP status a handler set (the HTTP API answers it as is)
    model_version: str | None = None  # the version it is about, where the request named none

    def __init__(self, message: str, reason: str | None = None, retry_after_s: float | None = None) -> None:
        message = shorten(message, MAX_MESSAGE)
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class InvalidArgument(InferenceError):
    """Malformed or out-of-range request field (INVALID_ARGUMENT)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class NotFound(InferenceError):
    """Unknown model or version (NOT_FOUND)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "MODEL_NOT_FOUND"


class AlreadyExists(InferenceError):
    """Model version registered twice (ALREADY_EXISTS)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "ALREADY_EXISTS"


class FailedPrecondition(InferenceError):
    """Request not valid in the current state (FAILED_PRECONDITION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class Unavailable(InferenceError):
    """No worker can take the request, or the server is stopping (UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"
    retry_after_s: float | None = 1.0


class ResourceExhausted(InferenceError):
    """Job queue full or size limit exceeded (RESOURCE_EXHAUSTED)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(InferenceError):
    """The request's deadline or the model's response_timeout passed (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"


class Cancelled(InferenceError):
    """The client cancelled the request (CANCELLED)."""

    code = grpc.StatusCode.CANCELLED
    reason = "CANCELLED"


class PermissionDenied(InferenceError):
    """The operation is switched off (PERMISSION_DENIED)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class HandlerError(InferenceError):
    """The handler raised; the message is the exception's (INTERNAL)."""

    code = grpc.StatusCode.INTERNAL
    reason = "HANDLER_ERROR"


class WorkerLoadError(InferenceError):
    """A worker failed to load its model; the message says why (INTERNAL)."""

    code = grpc.StatusCode.INTERNAL
    reason = "MODEL_LOAD_FAILED"


# TorchServe 0.12's table from an HTTP status a handler sets to a gRPC code
# (GRPCUtils.getGRPCStatusCode).
_HTTP_TO_GRPC: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    416: grpc.StatusCode.OUT_OF_RANGE,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code_for_http(status: int) -> grpc.StatusCode:
    """Map an HTTP status set by a handler to a gRPC code, as TorchServe 0.12's frontend does
    (``GRPCUtils.getGRPCStatusCode``).

    400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 NOT_FOUND, 409 ABORTED,
    413 and 429 RESOURCE_EXHAUSTED, 416 OUT_OF_RANGE, 499 CANCELLED, 501 UNIMPLEMENTED,
    503 UNAVAILABLE, 504 DEADLINE_EXCEEDED; other 2xx OK, other 4xx FAILED_PRECONDITION, other
    5xx INTERNAL, anything else UNKNOWN.
    """
    if status in _HTTP_TO_GRPC:
        return _HTTP_TO_GRPC[status]
    if 200 <= status < 300:
        return grpc.StatusCode.OK
    if 400 <= status < 500:
        return grpc.StatusCode.FAILED_PRECONDITION
    if 500 <= status < 600:
        return grpc.StatusCode.INTERNAL
    return grpc.StatusCode.UNKNOWN


_BY_CODE: dict[grpc.StatusCode, type[InferenceError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, Unavailable,
        ResourceExhausted, DeadlineExceeded, Cancelled, PermissionDenied, HandlerError,
    )
}


def error_for_code(code: grpc.StatusCode, message: str, http_status: int | None = None) -> InferenceError:
    """The error a worker reported for one request, as an :class:`InferenceError`.

    INTERNAL without an HTTP status is the handler's exception (reason HANDLER_ERROR); CANCELLED
    without one a cancel; anything else came from a status the handler set (TorchServe's
    table), reason HANDLER_STATUS, carrying ``http_status`` for the HTTP API.
    """
    if http_status is None:
        if code == grpc.StatusCode.CANCELLED:
            return Cancelled(message)
        if code == grpc.StatusCode.INTERNAL:
            return HandlerError(message)
    cls = _BY_CODE.get(code)
    error = cls(message, reason="HANDLER_STATUS") if cls is not None else InferenceError(message, "HANDLER_STATUS")
    error.code = code  # codes without a class of their own (ABORTED, OUT_OF_RANGE, ...)
    if code == grpc.StatusCode.OK:  # a 2xx error status: nothing to send as OK, so UNKNOWN as TorchServe would
        error.code = grpc.StatusCode.UNKNOWN
    error.http_status = http_status
    return error


# --------------------------------------------------------------------------- TorchServe's codes
#: ``grpc_status_codes`` values: this server's codes, or TorchServe 0.12's.
STATUS_CODES = ("default", "torchserve")
TORCHSERVE = "torchserve"
#: The inference RPCs: TorchServe answers their refusals INTERNAL where its management RPCs
#: answer NOT_FOUND (its ``InferenceImpl.prediction`` and ``OpenInferenceProtocolImpl.modelInfer``).
INFERENCE_RPCS = frozenset({"Predictions", "StreamPredictions", "StreamPredictions2", "ModelInfer"})
#: grpc-java's status of an exception the servicer did not catch (TorchServe's
#: ``ConflictStatusException`` and ``InvalidModelVersionException`` reach it).
UNCAUGHT = (grpc.StatusCode.UNKNOWN, "Application error processing RPC")
_JAVA = "org.pytorch.serve."
_MODEL_NOT_FOUND = _JAVA + "archive.model.ModelNotFoundException"
_VERSION_NOT_FOUND = _JAVA + "archive.model.ModelVersionNotFoundException"
_MODEL_EXCEPTION = _JAVA + "archive.model.ModelException"
_BAD_REQUEST = _JAVA + "http.BadRequestException"
_INTERNAL_SERVER = _JAVA + "http.InternalServerException"
_INFERENCE = grpc.StatusCode.INTERNAL  # every refusal of InferenceImpl.prediction


def _no_worker_message(name: str, version: str) -> str:
    """``ApiUtils.getStreamingInferenceErrorResponseMessage``."""
    shown = f'Model "{name}' + (f'" Version {version}' if version else "")
    return (shown + '" has no worker to serve inference request. Please use scale workers API to add '
            "workers. If this is a sequence inference, please check if it is closed, or expired; or "
            "exceeds maxSequenceJobQueueSize")


def torchserve_status(error: InferenceError, method: str, request: object = None,
                      in_band: bool = False) -> tuple[grpc.StatusCode, str]:
    """The code and message TorchServe 0.12 answers where this server refuses with ``error``.

    Read from TorchServe 0.12's frontend: ``InferenceImpl``, ``ManagementImpl``,
    ``OpenInferenceProtocolImpl`` (the Open Inference Protocol's ModelReady, ModelMetadata, ModelInfer),
    ``GRPCInterceptor``, ``GRPCJob.sendError``, ``ApiUtils``, ``ModelManager``,
    ``ModelVersionedRefs``, ``ModelArchive`` and ``WorkerThread``. Its messages end with a line
    naming the Java exception (``Status.augmentDescription``), reproduced here; ``in_band``
    (``StreamPredictions2``'s ``PredictionResponse.status``) carries the message alone, as TorchServe.
    An ``error.reason`` TorchServe has no refusal for keeps this server's code and message.

    Args:
        error: the refusal, as this server raises it (its ``reason`` selects the row).
        method: the RPC's name (``Predictions``, ``RegisterModel``, ...).
        request: the RPC's request message; its ``model_name`` (or ``name``), ``model_version`` (or
            ``version``), ``url`` and ``runtime`` fields, where it has them, are quoted as
            TorchServe's messages quote them.
        in_band: the status goes in a response message, not the call's status.
    """
    reason = error.reason
    inference = method in INFERENCE_RPCS
    name, version, url, runtime, short_name, short_version = (
        str(getattr(request, field, "") or "")
        for field in ("model_name", "model_version", "url", "runtime", "name", "version"))
    name, version = name or short_name, version or short_version or error.model_version or ""

    def java(code: grpc.StatusCode, message: str, exception: str) -> tuple[grpc.StatusCode, str]:
        return code, message if in_band else f"{message}\n{exception}"

    if reason == "UNAUTHENTICATED":  # GRPCInterceptor
        return grpc.StatusCode.PERMISSION_DENIED, (
            "Token Authorization failed. Token either incorrect, expired, or not provided correctly")
    if reason == "MODEL_API_DISABLED":
        return java(grpc.StatusCode.PERMISSION_DENIED, "Model API disabled", _MODEL_EXCEPTION)
    if reason == "MODEL_NAME_REQUIRED":
        if method == "ModelReady":  # sic: OpenInferenceProtocolImpl.modelReady's text
            return java(_INFERENCE, "Parameter name is required.", "BadRequestException.()")
        if inference or method == "ModelMetadata":
            return java(_INFERENCE, "Parameter model_name is required.", "BadRequestException.()")
        if method == "UnregisterModel":  # sic: ManagementImpl.unregisterModel's text
            return java(grpc.StatusCode.INVALID_ARGUMENT, "Parameter url is required.", _BAD_REQUEST)
        return java(grpc.StatusCode.NOT_FOUND, "Model not found: " + ("null" if method == "ScaleWorker" else ""),
                    _MODEL_NOT_FOUND)
    if reason == "MODEL_NOT_FOUND":
        return java(_INFERENCE if inference else grpc.StatusCode.NOT_FOUND, f"Model not found: {name}",
                    _MODEL_NOT_FOUND)
    if reason == "VERSION_NOT_FOUND":
        if method == "SetDefault":  # ModelVersionedRefs.setDefaultVersion
            return java(grpc.StatusCode.NOT_FOUND, f"Model version {version} does not exist for model {name}",
                        _VERSION_NOT_FOUND)
        return java(_INFERENCE if inference else grpc.StatusCode.NOT_FOUND,
                    f"Model version: {version} does not exist for model: {name}", _VERSION_NOT_FOUND)
    if reason == "VERSION_REQUIRED":  # SetDefault without a version: no version "" exists
        return java(grpc.StatusCode.NOT_FOUND, f"Model version  does not exist for model {name}", _VERSION_NOT_FOUND)
    if reason in ("NO_WORKER", "JOB_QUEUE_FULL", "MODEL_LOAD_FAILED") and inference:
        return java(_INFERENCE, _no_worker_message(name, version), "InternalServerException.()")
    if reason == "MODEL_LOAD_FAILED":  # a synchronous RegisterModel / ScaleWorker: ApiUtils.updateModelWorkers
        return java(grpc.StatusCode.INTERNAL,
                    f"Failed to start workers for model {name} version: {version or 'null'}", _INTERNAL_SERVER)
    if reason in ("WORKER_DIED", "RESPONSE_TIMEOUT"):  # WorkerThread: the worker is replaced
        return java(grpc.StatusCode.INTERNAL, "Worker died.", _INTERNAL_SERVER)
    if reason == "HANDLER_ERROR":  # ts/service.py: 507 for CUDA errors, 503 for anything else
        if "CUDA" in error.message:
            return java(grpc.StatusCode.INTERNAL, "CUDA out of memory", _INTERNAL_SERVER)
        return java(grpc.StatusCode.UNAVAILABLE, "Prediction failed", _INTERNAL_SERVER)
    if reason == "HANDLER_STATUS":
        return java(error.code, error.message, _INTERNAL_SERVER)
    if reason == "SEQUENCE_ID_REQUIRED":  # InferenceImpl.streamPredictions2
        return java(_INFERENCE, "Parameter sequenceId is required.", "BadRequestException.()")
    if reason == "URL_REQUIRED":
        return java(grpc.StatusCode.INVALID_ARGUMENT, "Parameter url is required.", _BAD_REQUEST)
    if reason == "ARCHIVE_NOT_FOUND":
        return java(grpc.StatusCode.NOT_FOUND, f"Model not found at: {url}", _MODEL_NOT_FOUND)
    if reason == "URL_NOT_ALLOWED":
        return java(grpc.StatusCode.NOT_FOUND, f"Given URL {url} does not match any allowed URL(s)",
                    _MODEL_NOT_FOUND)
    if reason == "RELATIVE_PATH":
        return java(grpc.StatusCode.NOT_FOUND, f"Relative path is not allowed in url: {url}", _MODEL_NOT_FOUND)
    if reason == "RUNTIME":
        return java(grpc.StatusCode.INVALID_ARGUMENT, f"Invalid RuntimeType value: {runtime}", _BAD_REQUEST)
    if reason == "MAX_BELOW_MIN":
        return java(grpc.StatusCode.INVALID_ARGUMENT, "max_worker cannot be less than min_worker.", _BAD_REQUEST)
    if reason == "VERSION_REGISTERED":
        if url.lower().startswith(("http://", "https://")):  # the download finds its file in the store
            filename = url.rstrip("/").rsplit("/", 1)[-1]
            return java(grpc.StatusCode.INTERNAL, f"Model file already exists {filename}", _INTERNAL_SERVER)
        return UNCAUGHT  # ModelVersionedRefs' ConflictStatusException
    if reason == "DEFAULT_VERSION":  # ApiUtils.unregisterModel's InvalidModelVersionException
        return UNCAUGHT
    return error.code, error.message
