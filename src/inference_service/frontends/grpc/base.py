"""The one place where errors become gRPC statuses.

Every failing RPC ends with the error's status code and message, plus a
``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer (read it with
``grpc_status.rpc_status.from_call``): an ``ErrorInfo`` (domain
``inference-service``, a stable ``reason``, metadata ``model_name`` /
``model_version`` when the request named them) and, where retrying can
succeed, a ``RetryInfo``. Anything that is not an
:class:`~inference_service.errors.InferenceError` becomes INTERNAL
"Internal server error" with the traceback in the log only.

The same decorators observe every RPC of both APIs: when it ends, its status
is counted (``inference_service_errors_total`` for errors) and its access-log
line written, through the servicer's ``telemetry`` attribute (a
:class:`~inference_service.observability.metrics.Telemetry`, or ``None``: nothing is recorded).
An RPC the client cancelled ends CANCELLED (DEADLINE_EXCEEDED when its deadline
passed). Large answers wait for room in the servicer's ``send_budget`` (:mod:`.send_budget`).

A servicer whose ``status_codes`` attribute is ``"torchserve"`` (``grpc_status_codes``) answers
each refusal with TorchServe 0.12's code and message instead
(:func:`inference_service.contracts.torchserve_status.torchserve_status`); the details keep this server's ``reason``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from inference_service.contracts.torchserve_status import TORCHSERVE, torchserve_status
from inference_service.errors import InferenceError, InvalidArgument, shorten
from inference_service.frontends.grpc.registration import Malformed
from inference_service.frontends.grpc.send_budget import CallBudget, SendBudget
from inference_service.frontends.request_ids import REQUEST_ID_HEADER, current, request_id
from inference_service.observability.metrics import Telemetry
from inference_service.serving.core import SERVED_VERSION

log = logging.getLogger("inference_service.rpc")

T = TypeVar("T")
INTERNAL_MESSAGE = "Internal server error"
DOMAIN = "inference-service"
MAX_MESSAGE = 1000  # characters of an error message sent
_OK = grpc.StatusCode.OK


def rich_status(exc: InferenceError, request: Any = None, code: grpc.StatusCode | None = None,
                message: str | None = None) -> grpc.Status:
    """The gRPC status of ``exc`` with ``ErrorInfo`` (and ``RetryInfo``) details; ``code`` and
    ``message`` replace the error's own (TorchServe's, see :func:`refusal`)."""
    metadata = {}
    for field in ("model_name", "model_version"):
        value = getattr(request, field, "")
        if isinstance(value, str) and value:
            metadata[field] = shorten(value)
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
    # the message goes out twice (grpc-message and the details): bounded, so that the status fits
    # the 8 KiB of headers clients accept whatever the request quoted
    message = shorten(exc.message if message is None else message, MAX_MESSAGE)
    code = exc.code if code is None else code
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=details))


def refusal(servicer: Any, error: InferenceError, method: str, request: Any = None,
            in_band: bool = False) -> tuple[grpc.StatusCode, str]:
    """The code and message ``servicer``'s ``method`` answers ``error`` with: the error's own, or
    TorchServe 0.12's when the servicer's ``status_codes`` is ``"torchserve"``."""
    if getattr(servicer, "status_codes", "default") == TORCHSERVE:
        return torchserve_status(error, method, request, in_band)
    return error.code, error.message


def as_inference_error(exc: BaseException, method: str) -> InferenceError:
    """``exc`` itself, or INTERNAL "Internal server error" for anything else (traceback logged)."""
    if isinstance(exc, InferenceError):
        return exc
    log.error("%s failed", method, exc_info=exc)
    return InferenceError(INTERNAL_MESSAGE)


def _failure(servicer: Any, exc: BaseException, method: str,
             request: Any) -> tuple[grpc.Status, grpc.StatusCode, str]:
    """The status an RPC that raised ``exc`` ends with, and its code and reason."""
    error = as_inference_error(exc, method)
    code, message = refusal(servicer, error, method, request)
    return rich_status(error, request, code, message), code, error.reason


def _name_call(context: grpc.aio.ServicerContext) -> str:
    """The call's request id (the client's ``x-request-id`` metadata, else a new one): made the
    task's current id (the handler's ``x-request-id`` header) and set as trailing metadata."""
    client = next((value for key, value in context.invocation_metadata() or ()
                   if key == REQUEST_ID_HEADER and isinstance(value, str)), None)
    rid = request_id(client)
    current.set(rid)
    context.set_trailing_metadata(((REQUEST_ID_HEADER, rid),))
    return rid


def _end_with(context: grpc.aio.ServicerContext, status: grpc.Status) -> None:
    """Make ``status`` (with its trailers) the RPC's status; the servicer method then returns.

    Not ``context.abort``: grpc.aio keeps the ``AbortError`` it raises on the call's state, and
    its traceback holds the servicer's frames with the request, in a reference cycle only the
    cycle collector frees, which large requests (few Python objects each) seldom trigger: each
    refused request of megabytes stayed in the server's memory for a long time.
    """
    context.set_code(status.code)
    context.set_details(status.details)
    context.set_trailing_metadata(((REQUEST_ID_HEADER, current.get()), *status.trailing_metadata))


def check_parsed(request: Any) -> None:
    """Raise INVALID_ARGUMENT for a request that did not parse (see :mod:`.registration`)."""
    if isinstance(request, Malformed):
        raise InvalidArgument(f"request message does not parse: {request.error}", reason="MALFORMED_REQUEST")


def _telemetry(servicer: Any) -> Telemetry | None:
    return getattr(servicer, "telemetry", None)


def _call_budget(servicer: Any, context: grpc.aio.ServicerContext) -> CallBudget | None:
    """The call's share of its connection's :class:`SendBudget` (the servicer's ``send_budget``),
    freed when the call ends; ``None`` without a budget."""
    budget: SendBudget | None = getattr(servicer, "send_budget", None)
    call = budget.call(context.peer()) if budget is not None else None
    if call is not None:
        context.add_done_callback(call.done)
    return call


def _deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The seconds the call had left when its handler started (``None``: no deadline)."""
    try:
        return context.time_remaining()
    except Exception:  # noqa: BLE001 - no deadline information
        return None


def _client_gone(context: grpc.aio.ServicerContext, budget: float | None) -> tuple[grpc.StatusCode, str]:
    """The status of an RPC whose handler was cancelled: its deadline passed, or the client cancelled.

    A client whose own deadline passes cancels the stream, and that cancel reaches the server
    before the server's copy of the deadline (counted from when the call arrived) runs out; so a
    cancel with less than ``max(0.25 s, a tenth of budget)`` left is the deadline's (``budget``:
    :func:`_deadline_of` at start). ``time_remaining()`` only reads the deadline kept with the
    call, so it is safe here; ``peer()`` is not (it crashes the process once a cancelled call is
    gone), hence the peer is read at start.
    """
    remaining = _deadline_of(context)
    if remaining is not None and remaining <= max(0.25, 0.1 * (budget or 0.0)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"
    return grpc.StatusCode.CANCELLED, "CANCELLED"


def _aborted_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The code of an RPC the servicer aborted itself (``context.abort``)."""
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc: unknown
        code = None
    if isinstance(code, grpc.StatusCode):
        return code
    return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)


def unary(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorate a unary servicer method: map raised errors to statuses; count and access-log the RPC."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        telemetry = _telemetry(self)
        start = time.perf_counter()
        peer = telemetry.peer(context) if telemetry is not None else ""
        rid = _name_call(context)
        deadline = _deadline_of(context)
        code, reason = _OK, ""
        try:
            try:
                check_parsed(request)
                budget = _call_budget(self, context)
                answer = await method(self, request, context)
                return answer if budget is None else await budget.admit(answer)
            except grpc.aio.AbortError:
                code = _aborted_code(context)
                raise
            except asyncio.CancelledError:
                code, reason = _client_gone(context, deadline)
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status here, and only here
                status, code, reason = _failure(self, exc, name, request)
            _end_with(context, status)
            return None  # type: ignore[return-value] # gRPC sends no message with a non-OK status
        finally:
            if telemetry is not None:
                telemetry.rpc_done(name, request, peer, code, reason, start, 1 if code is _OK else 0, rid,
                                   SERVED_VERSION.get())

    return wrapper


def _stream_wrapper(method: Callable[..., AsyncIterator[T]], parsed: bool) -> Callable[..., AsyncIterator[T]]:
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        telemetry = _telemetry(self)
        start = time.perf_counter()
        peer = telemetry.peer(context) if telemetry is not None else ""
        rid = _name_call(context)
        deadline = _deadline_of(context)
        code, reason, messages = _OK, "", 0
        try:
            status = None
            try:
                if parsed:
                    check_parsed(request)
                budget = _call_budget(self, context)
                # closed at once when an answer finds no room, so the handler's request ends
                async with contextlib.aclosing(method(self, request, context)) as items:  # type: ignore[type-var]
                    async for item in items:
                        yield item if budget is None else await budget.admit(item)
                        messages += 1  # gRPC asks for the next item once this one is written
            except grpc.aio.AbortError:
                code = _aborted_code(context)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code, reason = _client_gone(context, deadline)
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status here, and only here
                status, code, reason = _failure(self, exc, name, request)
            if status is not None:
                _end_with(context, status)
        finally:
            if telemetry is not None:
                # a bidirectional stream's requests may name several versions: its line names none
                telemetry.rpc_done(name, request, peer, code, reason, start, messages, rid,
                                   SERVED_VERSION.get() if parsed else "")

    return wrapper


def streaming(method: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Decorate a server-streaming servicer method (an async generator): map raised errors to
    statuses; count and access-log the RPC (with the number of messages sent)."""
    return _stream_wrapper(method, parsed=True)


def bidi_streaming(method: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Decorate a bidirectional-streaming servicer method (its request is an iterator), as
    :func:`streaming`. Its access line names no model: requests may name different ones."""
    return _stream_wrapper(method, parsed=False)
