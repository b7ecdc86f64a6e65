"""The one place where errors become gRPC statuses."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from inference_service.errors import InferenceError, InvalidArgument
from inference_service.servicers.registration import Malformed

log = logging.getLogger("inference_service.rpc")

T = TypeVar("T")
INTERNAL_MESSAGE = "Internal server error"


async def abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    """End the RPC with the status of ``exc``: its own code for an InferenceError,
    INTERNAL "Internal server error" (traceback logged) for anything else."""
    if isinstance(exc, InferenceError):
        await context.abort(exc.code, exc.message)
    log.error("%s failed", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def check_parsed(request: Any) -> None:
    """Raise INVALID_ARGUMENT for a request that did not parse (see :mod:`.registration`)."""
    if isinstance(request, Malformed):
        raise InvalidArgument(f"request message does not parse: {request.error}")


def unary(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorate a unary servicer method: map raised errors to statuses."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            check_parsed(request)
            return await method(self, request, context)
        except InferenceError as exc:
            await context.abort(exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await abort(context, exc, method.__name__)
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
        except InferenceError as exc:
            await context.abort(exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await abort(context, exc, method.__name__)

    return wrapper
