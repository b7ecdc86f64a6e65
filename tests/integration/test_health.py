"""grpc.health.v1 and Ping reflect what is really ready."""

from __future__ import annotations

import json
import time

import grpc
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ServerProcess, build_mar

READINESS = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _check(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _wait(channel: grpc.Channel, service: str, status: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _check(channel, service) != status:
        assert time.monotonic() < deadline, f"{service} never became {status}"
        time.sleep(0.05)


def test_health_on_both_ports(server):
    for channel in (server.channel, server.mchannel):
        assert _check(channel, "") == SERVING
        assert _check(channel, READINESS) == SERVING
        assert _check(channel, "model/echo") == SERVING
    try:
        _check(server.channel, "model/unknown")
        raise AssertionError("unknown service must be NOT_FOUND")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND


def test_model_health_follows_workers(server):
    server.register("echo.mar", model_name="healthy", initial_workers=1)
    _wait(server.channel, "model/healthy", SERVING)
    server.scale("healthy", 0)
    _wait(server.channel, "model/healthy", NOT_SERVING)
    server.unregister("healthy")
    _wait(server.channel, "model/healthy", NOT_SERVING)


def test_readiness_waits_for_startup_models(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "slow.yaml").write_text("load_delay: 2\nminWorkers: 1\n")
    build_mar(store, "slow", "slow_handler.py", config=str(store / "slow.yaml"))
    srv = ServerProcess(tmp_path / "work", store, ["--models", "slow=slow.mar"])
    try:
        # liveness at once, readiness and Ping only once the model's worker has loaded
        assert _check(srv.channel, "") == SERVING
        assert _check(srv.channel, READINESS) == NOT_SERVING
        assert _check(srv.channel, "model/slow") == NOT_SERVING
        ping = json.loads(srv.inference.Ping(empty_pb2.Empty(), timeout=5).health)
        assert ping == {"status": "Unhealthy", "code": 500}
        _wait(srv.channel, READINESS, SERVING)
        assert _check(srv.channel, "model/slow") == SERVING
        assert json.loads(srv.inference.Ping(empty_pb2.Empty(), timeout=5).health)["status"] == "Healthy"
    finally:
        assert srv.stop() == 0
