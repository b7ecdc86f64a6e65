"""The one place where a handler's outcome becomes frames to the server, for the worker's three
modes (:mod:`.runtime`, :mod:`.continuous`, :mod:`.async_runner`).

A request ends with exactly one ``FINAL`` (``str`` as UTF-8, ``bytes`` as is, else JSON) or
``ERROR`` (gRPC code, message, and the handler's HTTP status if any, TorchServe 0.12's table);
a traceback goes to the log only.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from inference_service.contracts import wire
from inference_service.errors import grpc_code_for_http
from inference_service.handler.context import Context
from inference_service.handler.encoding import encode_response
from inference_service.handler.util import PredictionException

log = logging.getLogger("inference_service.worker")

CANCELLED = 1  #: grpc.StatusCode.CANCELLED
INTERNAL = 13  #: grpc.StatusCode.INTERNAL
#: The HTTP status of a handler that raised (TorchServe's worker answers 503 "Prediction failed").
PREDICTION_FAILED = 503


def final(request_id: str, value: Any) -> bytes:
    """The ``FINAL`` frame of ``request_id``; TypeError when ``value`` cannot be encoded."""
    return wire.encode_response(wire.FINAL, request_id, encode_response(value))


def error(request_id: str, message: str, code: int = INTERNAL) -> bytes:
    """An ``ERROR`` frame with gRPC code number ``code`` and no HTTP status."""
    return wire.encode_error(request_id, code, message)


def cancelled(request_id: str) -> bytes:
    """The ``ERROR`` frame of a request whose client went away (or whose deadline passed)."""
    return wire.encode_error(request_id, CANCELLED, "request cancelled")


def status_error(context: Context, idx: int, request_id: str) -> bytes | None:
    """The ``ERROR`` frame of batch entry ``idx`` when the handler set it a status >= 400
    (``context.set_response_status``), else ``None``: the phrase it set (or the status's
    standard phrase), TorchServe's gRPC code for the status, and the status itself."""
    status, phrase = context.get_response_status(idx)
    if status < 400:
        return None
    phrase = phrase or _phrase(status)
    return wire.encode_error(request_id, _code(status), phrase, _http(status))


def result(context: Context, idx: int, request_id: str, value: Any) -> bytes:
    """The last frame of batch entry ``idx``: the status error the handler set, else ``FINAL``."""
    frame = status_error(context, idx, request_id)
    return frame if frame is not None else final(request_id, value)


def failed(request_ids: Sequence[str], exc: Exception) -> list[bytes]:
    """``ERROR`` frames for every request of a handler call that raised ``exc`` (a cancel is
    the caller's to answer): a ``PredictionException`` gives its code and HTTP status, anything
    else INTERNAL with the exception's message and HTTP status 503 (TorchServe's for a handler
    that raised, "Prediction failed"). Logs it (the traceback for a handler bug)."""
    if isinstance(exc, PredictionException):
        log.warning("handler raised PredictionException %s: %s", exc.error_code, exc.message)
        code, http = _code(exc.error_code), _http(exc.error_code)
        return [wire.encode_error(rid, code, exc.message, http) for rid in request_ids]
    log.error("handler failed on requests %s:\n%s", list(request_ids), traceback.format_exc())
    message = str(exc) or type(exc).__name__
    return [wire.encode_error(rid, INTERNAL, message, PREDICTION_FAILED) for rid in request_ids]


def _code(status: int) -> int:
    """The gRPC code number for an HTTP status (TorchServe 0.12's table)."""
    return int(grpc_code_for_http(status).value[0])


def _http(status: int) -> int:
    """``status`` as the ERROR frame's HTTP status field (0 when it is not an HTTP status)."""
    return status if 100 <= status <= 599 else 0


def _phrase(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"handler set status {status}"
