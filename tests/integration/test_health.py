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
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def _check(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _wait(channel: grpc.Channel, service: str, status: int, timeout: float = 30) -> None:
    """Poll until ``service`` reports ``status``; a model's name is NOT_FOUND until it is registered."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if _check(channel, service) == status:
                return
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
        assert time.monotonic() < deadline, f"{service} never became {status}"
        time.sleep(0.05)


def _check_code(channel: grpc.Channel, service: str) -> grpc.StatusCode:
    """The status code of a health Check (OK when it answered)."""
    try:
        _check(channel, service)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


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
    watch = health_pb2_grpc.HealthStub(server.channel).Watch(
        health_pb2.HealthCheckRequest(service="model/healthy"), timeout=30)
    assert next(watch).status == NOT_SERVING
    server.unregister("healthy")
    # no longer registered: an unknown service, as the gRPC health protocol specifies
    assert next(watch).status == SERVICE_UNKNOWN
    watch.cancel()
    deadline = time.monotonic() + 10
    while _check_code(server.channel, "model/healthy") != grpc.StatusCode.NOT_FOUND:
        assert time.monotonic() < deadline, "an unregistered model must be NOT_FOUND"
        time.sleep(0.05)
    server.register("echo.mar", model_name="healthy", initial_workers=1)
    _wait(server.channel, "model/healthy", SERVING)  # registered again: known again
    server.unregister("healthy")


def test_never_registered_model_is_unknown(server):
    assert _check_code(server.channel, "model/never-registered") == grpc.StatusCode.NOT_FOUND
    watch = health_pb2_grpc.HealthStub(server.channel).Watch(
        health_pb2.HealthCheckRequest(service="model/never-registered"), timeout=10)
    assert next(watch).status == SERVICE_UNKNOWN
    watch.cancel()


def test_readiness_stays_off_when_a_startup_model_fails(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    build_mar(store, "echo", "echo_handler.py")
    # the second startup model does not exist: the server serves echo, but is not ready
    srv = ServerProcess(tmp_path / "work", store, ["--models", "echo=echo.mar", "ghost=ghost.mar"])
    try:
        _wait(srv.channel, "model/echo", SERVING)
        assert _check(srv.channel, "") == SERVING
        assert _check(srv.channel, READINESS) == NOT_SERVING
        # Ping keeps TorchServe's rule (every registered model has its workers): healthy
        assert json.loads(srv.inference.Ping(empty_pb2.Empty(), timeout=5).health)["status"] == "Healthy"
    finally:
        assert srv.stop() == 0


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
