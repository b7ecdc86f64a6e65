"""The one place where errors become gRPC statuses.

Every failing RPC ends with the error's status code and message, plus a
``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer (read it with
``grpc_status.rpc_status.from_call``): an ``ErrorInfo`` (domain
``inference-service``, a stable ``reason``, metadata ``model_name`` /
``model_version`` when the request named them) and, where retrying can
succeed, a ``RetryInfo``. Anything that is not an
:class:`~inference_service.errors.InferenceError` becomes INTERNAL
"Internal server error" with the traceback in the log only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from inference_service.errors import InferenceError, InvalidArgument
from inference_service.servicers.registration import Malformed

log = logging.getLogger("inference_service.rpc")

T = TypeVar("T")
INTERNAL_MESSAGE = "Internal server error"
DOMAIN = "inference-service"


def rich_status(exc: InferenceError, request: Any = None) -> grpc.Status:
    """The gRPC status of ``exc`` with ``ErrorInfo`` (and ``RetryInfo``) details."""
    metadata = {}
    for field in ("model_name", "model_version"):
        value = getattr(request, field, "")
        if isinstance(value, str) and value:
            metadata[field] = value
    details = []
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=exc.reason, domain=DOMAIN, metadata=metadata))
    details.append(info)
    if exc.retry_after_s is not None:
        retry = any_pb2.Any()
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(exc.retry_after_s * 1000))
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(retry)
    return rpc_status.to_status(status_pb2.Status(code=exc.code.value[0], message=exc.message, details=details))


async def abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str, request: Any = None) -> None:
    """End the RPC with the status of ``exc`` (see the module docstring). Always raises."""
    if not isinstance(exc, InferenceError):
        log.error("%s failed", method, exc_info=exc)
        exc = InferenceError(INTERNAL_MESSAGE)
    status = rich_status(exc, request)
    await context.abort(status.code, status.details, status.trailing_metadata)


def check_parsed(request: Any) -> None:
    """Raise INVALID_ARGUMENT for a request that did not parse (see :mod:`.registration`)."""
    if isinstance(request, Malformed):
        raise InvalidArgument(f"request message does not parse: {request.error}", reason="MALFORMED_REQUEST")


def unary(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorate a unary servicer method: map raised errors to statuses."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            check_parsed(request)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status here, and only here
            await abort(context, exc, method.__name__, request)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    return wrapper


def streaming(method: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Decorate a streaming servicer method (an async generator): map raised errors to statuses."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            check_parsed(request)
            async for item in method(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status here, and only here
            await abort(context, exc, method.__name__, request)

    return wrapper
