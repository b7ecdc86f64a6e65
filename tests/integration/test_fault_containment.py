"""No single request takes a worker out of service: requests the worker channel cannot carry
are refused before they are queued, and anything that still fails on the way to a worker fails
only that batch while the worker stays in rotation."""

from __future__ import annotations

import time

import grpc
import pytest

from conftest import ServerProcess, read_key
from inference_service._proto import inference_pb2


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    """This module only reads: tests/conftest.py's session-wide echo server."""
    return shared_server


def _call(server, inputs: dict[str, bytes]):
    req = inference_pb2.PredictionsRequest(model_name="echo", input=inputs)
    return server.inference.Predictions(req, timeout=30)


@pytest.mark.parametrize("inputs, limit", [
    ({"data": b"x", **{f"k{i}": b"" for i in range(65_535)}}, "at most 65535"),
    ({"n" * 70_000: b"x"}, "longer than 65534 bytes"),
    ({"\u00e9" * 32_768: b"x"}, "longer than 65534 bytes"),  # 65,536 bytes in UTF-8
])
def test_requests_beyond_the_framing_are_refused_and_the_next_is_served(server, inputs, limit):
    with pytest.raises(grpc.RpcError) as err:
        _call(server, inputs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert limit in err.value.details()
    started = time.monotonic()
    for i in range(4):  # more than the model's workers: none of them was lost
        assert server.predict("echo", f"after {i}", timeout=10) == f"after {i}".encode()
    assert time.monotonic() - started < 5


def test_requests_at_the_limits_are_served(server):
    entries = {"data": b"edge", **{f"k{i}": b"" for i in range(65_534)}}  # 65,535 entries
    assert _call(server, entries).prediction == b"edge"
    assert _call(server, {"data": b"long name", "n" * 65_534: b""}).prediction == b"long name"


@pytest.mark.slow  # about 50 s on 2 cores
def test_a_burst_on_one_connection_is_served_or_refused_with_resource_exhausted(server):
    """2,000 calls at once on one connection, far beyond the job queue: each is served or gets
    RESOURCE_EXHAUSTED (which clients retry), none CANCELLED by the transport's backlog. Calls
    past ``grpc_max_concurrent_streams`` (100) that the client opened before it saw the limit
    may be refused by HTTP/2 before the server sees them (UNAVAILABLE, REFUSED_STREAM: safe to
    retry)."""
    import asyncio
    import collections

    from inference_service._proto import inference_pb2_grpc

    key = read_key(server.key_file, "inference")

    async def burst() -> collections.Counter[str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.inference_port}") as channel:
            stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
            request = inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"sleep:0.05"})

            async def one() -> str:
                try:
                    await stub.Predictions(request, timeout=120, metadata=[("authorization", f"Bearer {key}")])
                except grpc.aio.AioRpcError as err:
                    return f"{err.code().name}: {err.details()}"
                return "OK"
            return collections.Counter(await asyncio.gather(*(one() for _ in range(2000))))

    outcomes = asyncio.run(burst())
    assert outcomes["OK"] > 0, outcomes
    refused = {outcome for outcome in outcomes if outcome != "OK"}
    assert all(o.startswith("RESOURCE_EXHAUSTED: job queue is full") or "RST_STREAM with error code 7" in o
               for o in refused), outcomes
    assert server.predict("echo", "after the burst", timeout=10) == b"after the burst"
