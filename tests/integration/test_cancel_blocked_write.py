"""A client that stops reading a stream, so the server's write waits on gRPC flow control, then
cancels it: a normal event (access log CANCELLED), never a traceback in the server's log."""

from __future__ import annotations

import time

import grpc
import pytest

from conftest import ServerProcess, wait_for
from inference_service._proto import inference_pb2


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    """This module only reads: tests/conftest.py's session-wide echo server."""
    return shared_server


# 2000 messages of 32 KiB (64 MiB): far beyond the HTTP/2 windows of a client that does not read
COUNT, SIZE = 2000, 32 * 1024
ROUNDS = 12


def _blocked_then_cancelled(server, pause_s: float) -> None:
    body = f"streamclock:{COUNT}:{SIZE}".encode()
    request = inference_pb2.PredictionsRequest(model_name="echo", input={"data": body})
    call = server.inference.StreamPredictions(request, timeout=60)
    next(call)
    time.sleep(pause_s)  # the client stops reading: the scenario under test, not a wait for the server
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED


def test_cancel_while_a_write_waits_on_flow_control_logs_no_traceback(server):
    before = len(server.log())
    for round_ in range(ROUNDS):
        _blocked_then_cancelled(server, 0.05 + 0.05 * (round_ % 4))
    # every cancel is access-logged as CANCELLED once the server has seen it
    wait_for(lambda: server.log()[before:].count("StreamPredictions") >= ROUNDS, 10.0, 0.05,
             "access lines of the cancelled streams")
    assert server.predict("echo", "after", timeout=10) == b"after"
    log = server.log()[before:]
    assert "Traceback" not in log, log[-4000:]
    assert "ExecuteBatchError" not in log, log[-4000:]
