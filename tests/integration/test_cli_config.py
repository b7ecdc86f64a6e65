"""Command line and TorchServe config.properties, as a user's scripts would use them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from google.protobuf import empty_pb2

from conftest import ServerProcess, _alive, _descendants, auth_metadata
from inference_service._proto import inference_pb2, inference_pb2_grpc

TORCHSERVE_CONFIG = """\
# config.properties as a TorchServe deployment has it (inference_address and management_address on loopback here)
inference_address=http://127.0.0.1:8080
management_address=http://127.0.0.1:8081
metrics_address=http://0.0.0.0:8082
grpc_inference_port=0
grpc_management_port=0
number_of_netty_threads=32
job_queue_size=7
model_store={store}
load_models=echo.mar
default_workers_per_model=1
default_response_timeout=33
enable_envvars_config=true
install_py_dep_per_model=false
models={{"echo": {{"1.0": {{"defaultVersion": true, "marName": "echo.mar", "minWorkers": 1, \\
  "maxWorkers": 2, "batchSize": 3, "maxBatchDelay": 40}}}}}}
"""


def test_torchserve_config_properties_with_unsupported_keys(store, tmp_path):
    config = tmp_path / "config.properties"
    config.write_text(TORCHSERVE_CONFIG.format(store=store))
    srv = ServerProcess(tmp_path / "work", store, ["--ts-config", str(config)])
    try:
        srv.wait_workers("echo", 1)
        desc = srv.describe("echo")[0]
        assert desc["responseTimeout"] == 33
        assert desc["jobQueueStatus"]["remainingCapacity"] == 7
        assert (desc["batchSize"], desc["maxBatchDelay"], desc["maxWorkers"]) == (3, 40, 2)
        assert srv.predict("echo", "configured") == b"configured"
        log = srv.log()
        # (metrics_address, inference_address and management_address are supported: the Prometheus endpoint
        # and the HTTP APIs; enable_envvars_config reads the TS_* environment variables)
        assert log.count("config key 'number_of_netty_threads'") == 1 and "WARNING" in log
        assert "config key 'enable_envvars_config'" not in log
        # inference_address is TorchServe's HTTP API: supported; ServerProcess's --http-port 0 wins over 8080
        assert "config key 'inference_address'" not in log
        assert srv.status["http_address"] == "127.0.0.1" and srv.status["http_port"] not in (None, 0, 8080)
        assert f"HTTP inference API listening on 127.0.0.1:{srv.status['http_port']}" in log
        # management_address is TorchServe's HTTP management API: ServerProcess's --http-management-port 0 wins
        assert "config key 'management_address'" not in log
        assert srv.status["http_management_address"] == "127.0.0.1"
        assert srv.status["http_management_port"] not in (None, 0, 8081)
    finally:
        assert srv.stop() == 0


def test_malformed_config_value_is_a_clear_error(store, tmp_path):
    config = tmp_path / "config.properties"
    config.write_text("job_queue_size=lots\n")
    proc = subprocess.run([sys.executable, "-m", "inference_service", "--foreground", "--ts-config", str(config)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "job_queue_size" in proc.stderr and "lots" in proc.stderr
    for properties, args, message in (
            ("inference_address=unix:/tmp/ts.sock\n", [], "invalid value for inference_address"),
            ("inference_address=https://127.0.0.1:8443\n", [], "https:// inference_address needs certificate_file"),
            ("metrics_address=https://127.0.0.1:8445\n", [], "https:// metrics_address needs certificate_file"),
            ("", ["--http-port", "70000"], "port 70000 is out of range")):
        config.write_text(properties)
        proc = subprocess.run([sys.executable, "-m", "inference_service", "--foreground", "--ts-config", str(config),
                               *args], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2 and message in proc.stderr, (properties, args, proc.stderr)


def test_start_and_stop_in_background(store, tmp_path):
    env = {**os.environ}
    cmd = [sys.executable, "-m", "inference_service", "--start", "--ncs", "--model-store", str(store),
           "--models", "echo=echo.mar", "--workers-per-model", "1", "--no-http",
           "--grpc-inference-port", "0", "--grpc-management-port", "0", "--metrics-port", "0"]
    started = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=90, env=env, check=False)
    assert started.returncode == 0, started.stderr
    assert "inference-service started" in started.stdout
    status = json.loads((tmp_path / ".inference_service" / "status.json").read_text())
    pid = status["pid"]
    assert status["http_port"] is None and "HTTP" not in started.stdout  # --no-http
    assert status["http_management_port"] is None  # --no-http: neither HTTP API
    channel = grpc.insecure_channel(f"127.0.0.1:{status['inference_port']}")
    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    key_file = tmp_path / "key_file.json"  # token authorization is on by default
    assert status["key_file"] == str(key_file) and key_file.stat().st_mode & 0o777 == 0o600
    auth = auth_metadata(key_file, "inference")
    deadline = time.monotonic() + 30
    while True:  # the startup model loads in the background
        try:
            out = stub.Predictions(inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"bg"}),
                                   timeout=10, metadata=auth)
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert out.prediction == b"bg"
    assert "Healthy" in stub.Ping(empty_pb2.Empty(), timeout=5, metadata=auth).health
    workers = _descendants(pid)
    assert workers
    channel.close()
    # a second start in the same working directory refuses
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 1 and "already running" in again.stderr
    stopped = subprocess.run([sys.executable, "-m", "inference_service", "--stop"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, check=False)
    assert stopped.returncode == 0, stopped.stderr
    assert not _alive(pid)
    assert not any(_alive(p) for p in workers)
    assert (tmp_path / "logs" / "inference_service.log").is_file()
    assert not (tmp_path / ".inference_service" / "status.json").exists()
    assert not key_file.exists()  # deleted on stop


def test_stop_without_server(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "inference_service", "--stop"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 1 and "not running" in proc.stderr


def test_two_servers_side_by_side(store, tmp_path):
    a = ServerProcess(tmp_path / "a", store, ["--models", "echo=echo.mar", "--workers-per-model", "1"])
    b = ServerProcess(tmp_path / "b", store, ["--models", "echo=echo.mar", "--workers-per-model", "1"])
    try:
        assert a.inference_port != b.inference_port
        a.wait_workers("echo", 1)
        b.wait_workers("echo", 1)
        assert a.predict("echo", "a") == b"a" and b.predict("echo", "b") == b"b"
        extracted_a = list((tmp_path / "a" / ".inference_service").glob("models-*/*"))
        assert extracted_a and all(Path(p).is_dir() for p in extracted_a)
    finally:
        assert a.stop() == 0
        assert b.stop() == 0
