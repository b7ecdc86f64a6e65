"""Per-request flow control of intermediate responses: a worker sends at most a window of
them ahead of what the client took (protocol CREDIT frames), so a fast handler waits for a
slow client instead of flooding the frontend; cancels and unary calls still work."""

from __future__ import annotations

import time

import grpc
import pytest

from conftest import ServerProcess
from inference_service._proto import inference_pb2


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    """This module only reads: tests/conftest.py's session-wide echo server."""
    return shared_server


# 4000 messages of 4 KiB: 16 MiB, far beyond what gRPC's HTTP/2 windows buffer for a client
# that does not read, and far beyond the worker's window of intermediate responses.
COUNT, SIZE = 4000, 4096


def _request(count: int = COUNT, size: int = SIZE) -> inference_pb2.PredictionsRequest:
    return inference_pb2.PredictionsRequest(model_name="echo", input={"data": f"streamclock:{count}:{size}".encode()})


def _worker_pids(server) -> set[int]:
    return {w["pid"] for w in server.describe("echo")[0]["workers"]}


def test_a_client_that_pauses_holds_the_handler_back_and_loses_nothing(server):
    call = server.inference.StreamPredictions(_request(), timeout=120)
    first = next(call)
    paused_at = time.monotonic()
    time.sleep(1.5)  # the client stops reading: the scenario under test, not a wait for the server
    rest = [r.prediction for r in call]
    messages = [first.prediction, *rest[:-1]]
    assert len(messages) == COUNT
    assert all(m.startswith(f"{i}:".encode()) and len(m) == SIZE for i, m in enumerate(messages))
    handler_done = float(rest[-1])
    # Without flow control the handler sends 16 MiB in a fraction of a second, long before the
    # client reads again; with it, the handler can only finish after the client resumed.
    assert handler_done > paused_at + 1.0, handler_done - paused_at


def test_cancel_reaches_a_handler_that_waits_for_credit(server):
    pids = _worker_pids(server)
    call = server.inference.StreamPredictions(_request(), timeout=120)
    next(call)
    time.sleep(0.5)  # the client stops reading, so the handler runs out of credit
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    # The waiting handler saw the cancel: its worker is free again, not restarted or stuck.
    start = time.monotonic()
    for _ in range(8):
        assert server.predict("echo", "after", timeout=10) == b"after"
    assert time.monotonic() - start < 10
    assert _worker_pids(server) == pids


def test_unary_call_on_a_long_streaming_handler_gets_every_part(server):
    count, size = 1000, 64  # 1000 intermediate responses, far more than the window
    payload = server.predict("echo", f"streamclock:{count}:{size}", timeout=60)
    body, final = payload[: count * size], payload[count * size:]
    parts = [body[i * size:(i + 1) * size] for i in range(count)]
    assert all(p.startswith(f"{i}:".encode()) for i, p in enumerate(parts))
    assert float(final) > 0


def test_cancels_in_the_middle_of_writes_log_no_traceback(server):
    """Clients that cancel while their messages are being written: a normal event (the access
    log says CANCELLED), never a traceback in the server's log."""
    before = len(server.log())
    for taken in (1, 2, 5, 20, 64, 65, 200):
        call = server.inference.StreamPredictions(_request(count=400, size=64), timeout=60)
        for _ in range(taken):
            next(call)
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    # unary calls with a large answer, cancelled while it is on its way
    for _ in range(5):
        future = server.inference.Predictions.future(
            inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"repeat:3000000"}), timeout=60)
        time.sleep(0.05)  # cancel at some point of the call: the scenario, not a wait for the server
        future.cancel()
    # bidirectional sequence streams dropped by their client
    for _ in range(3):
        requests = iter([inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"stream:50:0.01"})])
        call = server.inference.StreamPredictions2(requests, timeout=60)
        next(call)
        call.cancel()
    assert server.predict("echo", "after", timeout=10) == b"after"
    log = server.log()[before:]
    assert "Traceback" not in log, log[-4000:]
