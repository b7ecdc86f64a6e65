"""The worker's one answer path (``worker/answers.py``): what each handler outcome becomes on the
wire, decoded back; and ``LOCAL_RANK``, read once when the handler's context is made."""

from __future__ import annotations

import pytest

from inference_service.contracts import wire
from inference_service.handler.context import Context
from inference_service.handler.streaming import send_intermediate_predict_response
from inference_service.handler.util import PredictionException
from inference_service.worker import answers


def _context(ids: list[str]) -> Context:
    context = Context("m", "/tmp", {}, batch_size=len(ids), gpu=None, server_version="test")
    context.begin_batch(ids, [{} for _ in ids], [None for _ in ids])
    return context


def _decode(frame: bytes) -> tuple:
    length, kind = wire.HEADER.unpack(frame[:wire.HEADER.size])
    body = frame[wire.HEADER.size:]
    assert length == len(body) + 1  # the length counts the kind byte
    if kind == wire.ERROR:
        return ("ERROR", *wire.decode_error(body))
    return (kind, *wire.decode_response(body))


def test_a_result_is_final_unless_the_handler_set_a_status():
    context = _context(["a", "b", "c"])
    context.set_response_status(418, "handler says no", 1)
    context.set_response_status(503, "", 2)
    assert _decode(answers.result(context, 0, "a", {"x": 1})) == (wire.FINAL, "a", b'{"x": 1}')
    # the status keeps its phrase, TorchServe's gRPC code and the HTTP status itself
    assert _decode(answers.result(context, 1, "b", "ignored")) == ("ERROR", "b", 9, "handler says no", 418)
    assert _decode(answers.result(context, 2, "c", "ignored")) == ("ERROR", "c", 14, "503 Service Unavailable", 503)
    assert answers.status_error(context, 0, "a") is None


def test_a_value_that_cannot_be_encoded_raises():
    with pytest.raises(TypeError):
        answers.final("a", object())


def test_failures_become_one_error_per_request():
    try:
        raise PredictionException("too many", 429)
    except PredictionException as exc:
        frames = answers.failed(["a", "b"], exc)
    assert [_decode(f) for f in frames] == [("ERROR", "a", 8, "too many", 429), ("ERROR", "b", 8, "too many", 429)]
    try:
        raise ValueError()
    except ValueError as exc:
        (frame,) = answers.failed(["a"], exc)
    assert _decode(frame) == ("ERROR", "a", 13, "ValueError", 503)  # no message: its type; HTTP 503 as TorchServe
    assert _decode(answers.cancelled("a")) == ("ERROR", "a", 1, "request cancelled", 0)


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def send_intermediate(self, request_id: str, payload: bytes, headers: dict | None = None) -> None:
        self.sent.append((request_id, payload))

    def is_cancelled(self, request_id: str) -> bool:
        return False


@pytest.mark.parametrize("rank,sends", [(None, True), ("0", True), ("1", False)])
def test_local_rank_is_read_once_when_the_context_is_made(monkeypatch, rank, sends):
    if rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", rank)
    context = _context(["a"])
    channel = _Recorder()
    context.bind_channel(channel)
    monkeypatch.setenv("LOCAL_RANK", "0" if rank == "1" else "1")  # later changes do not count
    send_intermediate_predict_response(["part"], context.request_ids, "Result", 200, context)
    assert channel.sent == ([("a", b"part")] if sends else [])
