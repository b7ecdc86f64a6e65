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

    INTERNAL without an HTTP status or with 503 (TorchServe's for a handler that raised) is the
    handler's exception (reason HANDLER_ERROR, carrying the 503); CANCELLED without one a cancel;
    anything else came from a status the handler set (TorchServe's table, where 503 is
    UNAVAILABLE), reason HANDLER_STATUS, carrying ``http_status`` for the HTTP API.
    """
    if http_status is None and code == grpc.StatusCode.CANCELLED:
        return Cancelled(message)
    if code == grpc.StatusCode.INTERNAL and http_status in (None, 503):
        raised = HandlerError(message)
        raised.http_status = http_status
        return raised
    cls = _BY_CODE.get(code)
    error = cls(message, reason="HANDLER_STATUS") if cls is not None else InferenceError(message, "HANDLER_STATUS")
    error.code = code  # codes without a class of their own (ABORTED, OUT_OF_RANGE, ...)
    if code == grpc.StatusCode.OK:  # a 2xx error status: nothing to send as OK, so UNKNOWN as TorchServe would
        error.code = grpc.StatusCode.UNKNOWN
    error.http_status = http_status
    return error
