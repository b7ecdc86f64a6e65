"""Intermediate responses from inside a handler (TorchServe's streaming API)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from inference_service.handler.context import Context
from inference_service.handler.encoding import encode_response


class RequestCancelled(BaseException):
    """Raised into a handler when every request it is streaming to was cancelled.

    Derives from ``BaseException`` (like ``KeyboardInterrupt``) so a handler's
    ``except Exception:`` does not swallow it; the worker catches it, answers
    the batch as cancelled and stays ready for the next request.
    """


def send_intermediate_predict_response(
    ret: Sequence[Any],
    req_id_map: Mapping[int, str],
    message: str,
    code: int,
    context: Context,
) -> None:
    """Send ``ret[i]`` as an intermediate response to the client of request ``req_id_map[i]``.

    TorchServe's signature and behaviour: the handler keeps running, and what it
    finally returns is the stream's last message. ``message`` and ``code`` are
    accepted for compatibility (TorchServe sends them as the HTTP status of the
    chunk; gRPC has no per-message status). Does nothing where the environment
    variable ``LOCAL_RANK`` is set and is not ``"0"`` (only rank 0 answers;
    ``context.answers_clients``, read when the worker starts).

    Args:
        ret: one value per batch entry, encoded like a handler result.
        req_id_map: batch index -> request id (``context.request_ids``).
        message: status phrase (ignored on gRPC).
        code: HTTP status (ignored on gRPC).
        context: the handler's context.

    Returns:
        ``None``.

    Raises:
        RequestCancelled: every request in ``req_id_map`` was cancelled by its
            client (or its deadline passed), so the handler stops here.
        TypeError: a value cannot be encoded.
    """
    if not context.answers_clients:
        return None
    channel = context._channel
    if channel is None:
        raise RuntimeError("send_intermediate_predict_response called outside a worker")
    live = 0
    for idx, request_id in req_id_map.items():
        if channel.is_cancelled(request_id):
            continue
        channel.send_intermediate(request_id, encode_response(ret[idx]))
        live += 1
    if req_id_map and live == 0:
        raise RequestCancelled("all requests of this batch were cancelled")
    return None
