"""Intermediate responses from inside a handler (TorchServe's streaming API)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from inference_service.handler.context import Context
from inference_service.handler.encoding import encode_response


class RequestCancelled(BaseException):
    """Raised into a handler when every request it streams to was cancelled; a ``BaseException`` so a
    handler's ``except Exception:`` does not swallow it."""


def send_intermediate_predict_response(
    ret: Sequence[Any],
    req_id_map: Mapping[int, str],
    message: str,
    code: int,
    context: Context,
) -> None:
    """Send ``ret[i]`` as an intermediate response to the client of request ``req_id_map[i]``.

    TorchServe's signature and behaviour; ``message`` and ``code`` are accepted but gRPC has no
    per-message status. Does nothing on a rank other than 0 (``LOCAL_RANK``, read at worker start).

    Raises:
        RequestCancelled: every request in ``req_id_map`` was cancelled (or passed its deadline).
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
        channel.send_intermediate(request_id, encode_response(ret[idx]), context.get_response_headers(idx))
        live += 1
    if req_id_map and live == 0:
        raise RequestCancelled("all requests of this batch were cancelled")
    return None
