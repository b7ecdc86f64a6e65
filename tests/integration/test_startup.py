"""``inference-service --start`` says what happened (issue 14), and the Python floor is stated truthfully.

``--start`` returns once the startup models are READY (``--wait-ready 0``: registered), and
exits 1 with the cause on stderr, leaving nothing running, when the model store does not
exist, a startup archive is missing, a startup model cannot load, or a port is in use.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import ROOT, ServerProcess, _alive, auth_metadata, wait_for
from inference_service._proto import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc

FREE_PORTS = ["--grpc-inference-port", "0", "--grpc-management-port", "0", "--http-port", "0",
              "--http-management-port", "0", "--metrics-port", "0"]


def _cli(workdir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inference_service", *args], cwd=workdir, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A working directory whose background server, if one was left running, is stopped afterwards."""
    yield tmp_path
    if (tmp_path / ".inference_service" / "inference_service.pid").exists():
        _cli(tmp_path, "--stop", timeout=60)


def _status(workdir: Path) -> dict:
    return json.loads((workdir / ".inference_service" / "status.json").read_text())


def _nothing_running(workdir: Path) -> bool:
    return not (workdir / ".inference_service" / "status.json").exists()


def test_start_returns_with_the_startup_models_ready(store, workdir):
    started = _cli(workdir, "--start", "--ncs", "--model-store", str(store), "--models", "echo=echo.mar",
                   "--workers-per-model", "1", *FREE_PORTS)
    assert started.returncode == 0, started.stderr
    assert "inference-service started" in started.stdout and "models ready: echo" in started.stdout
    status = _status(workdir)
    # the started line lists every port the server listens on
    for api, key in (("gRPC inference", "inference"), ("gRPC management", "management"), ("HTTP inference", "http"),
                     ("HTTP management", "http_management")):
        assert f"{api} 127.0.0.1:{status[key + '_port']}" in started.stdout, (api, started.stdout)
    assert f"metrics http://127.0.0.1:{status['metrics_port']}/metrics" in started.stdout
    with grpc.insecure_channel(f"127.0.0.1:{status['inference_port']}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        # at once, no retry: TorchServe registers the startup models before it reports started
        reply = stub.Predictions(inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"now"}),
                                 timeout=10, metadata=auth_metadata(workdir / "key_file.json", "inference"))
    assert reply.prediction == b"now"
    assert _cli(workdir, "--stop").returncode == 0


def test_start_wait_ready_zero_returns_once_registered(store, workdir):
    started = _cli(workdir, "--start", "--ncs", "--model-store", str(store), "--models", "echo=echo.mar",
                   "--workers-per-model", "1", "--wait-ready", "0", *FREE_PORTS)
    assert started.returncode == 0, started.stderr
    assert "models registered: echo" in started.stdout
    status = _status(workdir)
    with grpc.insecure_channel(f"127.0.0.1:{status['management_port']}") as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        desc = json.loads(stub.DescribeModel(management_pb2.DescribeModelRequest(model_name="echo"), timeout=10,
                                             metadata=auth_metadata(workdir / "key_file.json", "management")).msg)
    assert desc[0]["modelName"] == "echo"
    assert _cli(workdir, "--stop").returncode == 0


def test_start_refuses_a_model_store_that_does_not_exist(workdir):
    missing = workdir / "no_such_store"
    for mode in ("--start", "--foreground"):
        proc = _cli(workdir, mode, "--ncs", "--model-store", str(missing), *FREE_PORTS, timeout=60)
        assert proc.returncode == 1, (mode, proc.stdout, proc.stderr)
        assert f"--model-store directory not found: {missing}" in proc.stderr  # TorchServe's text
        assert _nothing_running(workdir)


def test_start_refuses_a_missing_or_unreadable_startup_archive(store, workdir):
    proc = _cli(workdir, "--start", "--ncs", "--model-store", str(store), "--models", "echo=echo.mar",
                "missing.mar", "cfg=seq-config.yaml", *FREE_PORTS)
    assert proc.returncode == 1
    assert "startup model missing.mar: model archive 'missing.mar' not found in the model store" in proc.stderr
    assert "startup model cfg: seq-config.yaml is not a model archive" in proc.stderr
    assert _nothing_running(workdir)


def test_start_reports_a_startup_model_that_cannot_load_and_stops(store, workdir):
    proc = _cli(workdir, "--start", "--ncs", "--model-store", str(store), "--models", "echo=echo.mar",
                "broken=broken.mar", "--workers-per-model", "1", *FREE_PORTS)
    assert proc.returncode == 1, proc.stdout
    assert "startup model broken cannot load: model broken failed to load:" in proc.stderr
    assert "RuntimeError: weights are corrupt (test)" in proc.stderr
    pid = int(re.search(r"the server \(pid (\d+)\) was stopped", proc.stderr)[1])
    assert not _alive(pid) and _nothing_running(workdir)


def test_status_file_has_each_startup_models_state_and_error(store, tmp_path):
    """The server writes every startup model's outcome into status.json (``--start`` reads it there)."""
    srv = ServerProcess(tmp_path, store, ["--models", "echo=echo.mar", "broken=broken.mar", "missing.mar",
                                          "--workers-per-model", "1"])
    try:
        assert set(srv.status["models"]) == {"echo", "broken", "missing.mar"}  # listed from the first write

        def settled() -> dict | None:
            models = json.loads((tmp_path / ".inference_service" / "status.json").read_text())["models"]
            done = models["echo"]["state"] == "ready" and all(
                models[key]["state"] == "failed" for key in ("broken", "missing.mar"))
            return models if done else None

        models = wait_for(settled, timeout=60, interval=0.1, what="startup models ready or failed")
        assert models["echo"] == {"state": "ready", "model_name": "echo", "version": "1.0"}
        broken = models["broken"]
        assert broken["model_name"] == "broken" and broken["version"]  # registered, its workers fail to load
        assert broken["error"].startswith("model broken failed to load:")
        assert "RuntimeError: weights are corrupt (test)" in broken["error"]
        missing = models["missing.mar"]
        assert "version" not in missing  # never registered
        assert "model archive 'missing.mar' not found in the model store" in missing["error"]
    finally:
        srv.stop()
    assert not (tmp_path / ".inference_service" / "status.json").exists()


def test_start_names_a_port_in_use_and_its_holder(workdir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _cli(workdir, "--start", "--ncs", *FREE_PORTS, "--grpc-management-port", str(port), timeout=60)
    assert proc.returncode == 1
    assert f"port {port} (management API, 127.0.0.1) is already in use by pid {os.getpid()}" in proc.stderr
    assert _nothing_running(workdir)


def test_port_clash_lists_every_port_and_stop_names_the_run_directory(workdir, tmp_path_factory):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _cli(workdir, "--start", "--ncs", *FREE_PORTS, "--http-management-port", str(port),
                    "--grpc-health-port", "0", timeout=60)
    assert proc.returncode == 1
    assert f"port {port} (HTTP management API, 127.0.0.1) is already in use by pid {os.getpid()}" in proc.stderr
    assert (f"the server's ports: inference any (--grpc-inference-port), management any (--grpc-management-port), "
            f"HTTP inference any (--http-port), HTTP management {port} (--http-management-port), "
            "metrics any (--metrics-port), health any (--grpc-health-port)") in proc.stderr
    assert _nothing_running(workdir)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    stop = _cli(elsewhere, "--stop", timeout=60)
    assert stop.returncode == 1
    assert f"no live server in the run directory {elsewhere / '.inference_service'}" in stop.stderr
    assert "--run-dir" in stop.stderr


def test_python_floor_is_3_11(tmp_path):
    assert 'requires-python = ">=3.11"' in (ROOT / "pyproject.toml").read_text()
    # scripts/install refuses an older interpreter before it creates anything
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install", tmp_path / "scripts" / "install")
    old = tmp_path / "python3.10"
    old.write_text("#!/bin/sh\n"
                   "case \"$1\" in --version) echo 'Python 3.10.14' ;; *) exit 1 ;; esac\n")
    old.chmod(0o755)
    proc = subprocess.run([str(tmp_path / "scripts" / "install")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": str(old)}, check=False)
    assert proc.returncode == 1
    assert "needs Python 3.11 or newer" in proc.stderr and "Python 3.10.14" in proc.stderr
    assert not (tmp_path / ".venv").exists()


def test_foreground_bind_failure_lists_every_port(workdir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _cli(workdir, "--foreground", "--ncs", *FREE_PORTS, "--http-management-port", str(port), timeout=60)
    assert proc.returncode == 1
    assert f"cannot bind the HTTP management API to 127.0.0.1:{port}" in proc.stderr
    assert (f"the server's ports: inference any (--grpc-inference-port), management any (--grpc-management-port), "
            f"HTTP inference any (--http-port), HTTP management {port} (--http-management-port), "
            "metrics any (--metrics-port)") in proc.stderr
    assert _nothing_running(workdir)


def test_start_names_models_and_repeats_the_thread_warning(store, workdir):
    """load_models=echo.mar is the model echo; three models whose handlers use torch, each taking
    every CPU for its one worker, are more threads than CPUs: --start says so on its terminal,
    once. echo and fn load no library with a thread pool and do not count."""
    started = _cli(workdir, "--start", "--ncs", "--model-store", str(store), "--models", "echo.mar", "fn.mar",
                   "d1=doubler.mar", "d2=doubler.mar", "d3=doubler.mar", "--workers-per-model", "1", *FREE_PORTS)
    assert started.returncode == 0, started.stderr
    ready = re.search(r"models ready: ([\w, ]+);", started.stdout)
    assert ready and set(ready[1].split(", ")) == {"d1", "d2", "d3", "echo", "fn"}, started.stdout
    warning = [line for line in started.stderr.splitlines() if line.startswith("inference-service: warning: ")]
    assert len(warning) == 1 and "workers x threads = " in warning[0] and "usable CPUs" in warning[0], started.stderr
    assert "echo 1x" not in warning[0] and "fn 1x" not in warning[0]
    assert (workdir / "logs" / "inference_service.log").is_file()
    assert _cli(workdir, "--stop").returncode == 0


def test_handlers_without_a_thread_pool_are_not_warned_about(store, workdir):
    started = _cli(workdir, "--start", "--ncs", "--model-store", str(store), "--models", "e1=echo.mar", "e2=echo.mar",
                   "e3=echo.mar", "fn.mar", "--workers-per-model", "1", *FREE_PORTS)
    assert started.returncode == 0, started.stderr
    assert "warning" not in started.stderr, started.stderr
    assert _cli(workdir, "--stop").returncode == 0
