"""KServe's kserve-torchserve runtime as written: its container argv (``torchserve --start
--model-store=... --ts-config=...``), its sample config.properties (v1 and v2: one address for both
HTTP APIs, ``model_snapshot``, ``enable_envvars_config``), the ``TS_SERVICE_ENVELOPE`` KServe sets,
and its sample requests, verbatim but for the port numbers (tests/data/kserve)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf import json_format
from kserve_files import (
    KSERVE,
    build_mnist,
    config_with_ports,
    console_script,
    expected_digit,
    free_port,
    mnist_weights,
    v1_tensor,
    v2_tensor,
)

from conftest import ROOT, ServerProcess, read_key, wait_for
from inference_service._proto import grpc_predict_v2_pb2, grpc_predict_v2_pb2_grpc


@dataclass
class Runtime:
    """A server started as KServe's runtime container starts it, in ``workdir``."""

    workdir: Path
    ports: dict[int, int]  #: KServe's port -> the one used here
    torchserve: Path
    env: dict[str, str]

    def url(self, path: str, port: int = 8085) -> str:
        return f"http://127.0.0.1:{self.ports[port]}{path}"

    def log(self) -> str:
        """The server's log ("" before it wrote one: a start that failed early shows its own output)."""
        path = self.workdir / "logs" / "inference_service.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        proc = subprocess.run([str(self.torchserve), "--stop"], cwd=self.workdir, env=self.env, capture_output=True,
                              text=True, timeout=90, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def _runtime_argv(model_store: Path, config: Path) -> list[str]:
    """The kserve-torchserve ClusterServingRuntime's container args, its volume paths mapped here,
    with the args of KServe's sample InferenceService (v1/torchserve.yaml) after them."""
    (runtime,) = yaml.safe_load_all((KSERVE / "kserve-torchserve.yaml").read_text())
    args = runtime["spec"]["containers"][0]["args"]
    assert args == ["torchserve", "--start", "--model-store=/mnt/models/model-store",
                    "--ts-config=/mnt/models/config/config.properties"]
    isvc = yaml.safe_load((KSERVE / "v1" / "torchserve.yaml").read_text())
    mapped = [a.replace("/mnt/models/model-store", str(model_store)).replace(
        "/mnt/models/config/config.properties", str(config)) for a in args[1:]]
    return mapped + isvc["spec"]["predictor"]["pytorch"]["args"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mnist_weights(tmp_path_factory.mktemp("mnist") / "mnist_cnn.pt")


def _start(tmp: Path, protocol: str, envelope: str, weights: Path) -> Runtime:
    store = tmp / "mnt" / "models" / "model-store"
    store.mkdir(parents=True)
    assert build_mnist(store, weights) == "mnist.mar"
    ports = {port: free_port() for port in (8085, 8082, 7070, 7071)}
    config = tmp / "mnt" / "models" / "config" / "config.properties"
    config.parent.mkdir(parents=True)
    config.write_text(config_with_ports(protocol, ports))
    torchserve = console_script("torchserve", tmp / "bin")
    # what KServe's runtime sets: TS_SERVICE_ENVELOPE from the serviceEnvelope label (kserve for the
    # v1 protocol, kservev2 for v2 and grpc-v2), and PROTOCOL_VERSION
    env = {**os.environ, "TS_SERVICE_ENVELOPE": envelope, "PROTOCOL_VERSION": protocol}
    workdir = tmp / "home"
    workdir.mkdir()
    proc = subprocess.run([str(torchserve), *_runtime_argv(store, config)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    runtime = Runtime(workdir, ports, torchserve, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr + runtime.log()[-3000:]
    assert "models ready: mnist" in proc.stdout, proc.stdout
    return runtime


@pytest.fixture(scope="module")
def v1(tmp_path_factory: pytest.TempPathFactory, weights: Path) -> Iterator[Runtime]:
    runtime = _start(tmp_path_factory.mktemp("kserve_v1"), "v1", "kserve", weights)
    try:
        yield runtime
    finally:
        runtime.stop()


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory, weights: Path) -> Iterator[Runtime]:
    runtime = _start(tmp_path_factory.mktemp("kserve_v2"), "v2", "kservev2", weights)
    try:
        yield runtime
    finally:
        runtime.stop()


def _http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
          method: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_v1_sample_request_and_config(v1: Runtime, weights: Path) -> None:
    # KServe's README: curl ... /v1/models/mnist:predict -d @./mnist.json (curl's -d sends a form type)
    body = (KSERVE / "v1" / "mnist.json").read_bytes()
    status, answer = _http(v1.url("/v1/models/mnist:predict"), body,
                           {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200, answer
    assert answer == {"predictions": [expected_digit(weights, v1_tensor())]}
    # TorchServe's own route, same envelope
    assert _http(v1.url("/predictions/mnist"), body, {"Content-Type": "application/json"}) == (200, answer)
    status, missing = _http(v1.url("/v1/models/nope:predict"), b"{}")
    assert (status, missing["type"]) == (404, "ModelNotFoundException")

    # the management API answers on the same port; model_snapshot's settings are the model's
    status, models = _http(v1.url("/models"))
    assert (status, [m["modelName"] for m in models["models"]]) == (200, ["mnist"])
    status, (described,) = _http(v1.url("/models/mnist"))
    assert status == 200
    assert {k: described[k] for k in ("modelVersion", "minWorkers", "maxWorkers", "batchSize", "maxBatchDelay",
                                       "responseTimeout")} == {
        "modelVersion": "1.0", "minWorkers": 1, "maxWorkers": 5, "batchSize": 1, "maxBatchDelay": 5000,
        "responseTimeout": 120}
    with urllib.request.urlopen(v1.url("/metrics", 8082), timeout=10) as response:
        assert "ts_inference_requests_total" in response.read().decode()

    log = v1.log()
    for key in ("metrics_format", "number_of_netty_threads"):  # TorchServe 0.12 does not read them either
        assert f"config key '{key}'" in log
    for key in ("model_snapshot", "enable_envvars_config", "install_py_dep_per_model", "management_address"):
        assert f"config key '{key}'" not in log
    assert f"HTTP inference and management APIs listening on 0.0.0.0:{v1.ports[8085]}" in log


def test_v1_grpc_sample_client_verbatim(v1: Runtime, tmp_path: Path) -> None:
    """KServe's torchserve_grpc_client.py with stubs generated as its README says."""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={ROOT / 'protos'}",
                    f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", "inference.proto",
                    "management.proto"], check=True, timeout=60, cwd=ROOT / "protos")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    outputs = []
    for api in ("ping", "infer"):
        proc = subprocess.run([sys.executable, str(KSERVE / "v1" / "torchserve_grpc_client.py"), "--host", "127.0.0.1",
                               "--port", str(v1.ports[7070]), "--model", "mnist", "--api_name", api,
                               "--input_path", str(KSERVE / "v1" / "mnist.json")],
                              env=env, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outputs.append(proc.stdout)
    assert "Healthy" in outputs[0]
    status, http_answer = _http(v1.url("/v1/models/mnist:predict"), (KSERVE / "v1" / "mnist.json").read_bytes())
    assert json.loads(outputs[1]) == http_answer


def test_v2_sample_requests_http_and_grpc(v2: Runtime, weights: Path) -> None:
    want = expected_digit(weights, v2_tensor())
    status, answer = _http(v2.url("/v2/models/mnist/infer"), (KSERVE / "v2" / "mnist_v2.json").read_bytes())
    assert status == 200, answer
    assert answer["id"] == "d3b15cad-50a2-4eaf-80ce-8b0a428bd298"
    assert [(o["datatype"], o["data"]) for o in answer["outputs"]] == [("INT64", [want])]

    request = json_format.ParseDict(json.loads((KSERVE / "v2" / "mnist_v2_tensor_grpc.json").read_text()),
                                    grpc_predict_v2_pb2.ModelInferRequest())
    with grpc.insecure_channel(f"127.0.0.1:{v2.ports[7070]}") as channel:
        reply = grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert (reply.model_name, reply.id) == ("mnist", request.id)
    assert [list(o.contents.int64_contents) for o in reply.outputs] == [[want]]
    status, (described,) = _http(v2.url("/models/mnist"))
    assert (described["batchSize"], described["maxBatchDelay"], described["responseTimeout"]) == (2, 500, 60)


def test_one_port_keeps_each_api_key(store: Path, tmp_path: Path) -> None:
    """inference_address = management_address with token authorization on: one port, each API its key."""
    port = free_port()
    srv = ServerProcess(tmp_path, store, ["--models", "echo=echo.mar", "--workers-per-model", "1",
                                          "--http-port", str(port), "--http-management-port", str(port)])
    try:
        srv.wait_workers("echo", 1)
        assert srv.status["http_port"] == srv.status["http_management_port"] == port
        inference = {"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}"}
        management = {"Authorization": f"Bearer {read_key(srv.key_file, 'management')}"}
        base = f"http://127.0.0.1:{port}"
        assert _http(f"{base}/models", headers=inference)[0] == 401
        assert _http(f"{base}/models", headers=management)[0] == 200
        request = urllib.request.Request(f"{base}/predictions/echo", data=b"one port",
                                         headers={**inference, "Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.read() == b"one port"
        assert _http(f"{base}/predictions/echo", b"x", management)[0] == 401
        status, missing = _http(f"{base}/nowhere", headers=inference)
        assert (status, missing["type"]) == (404, "ResourceNotFoundException")
        assert _http(f"{base}/models/echo", headers=management, method="POST")[0] == 405
        wait_for(lambda: f"HTTP inference and management APIs listening on 127.0.0.1:{port}" in srv.log(), 5)
    finally:
        assert srv.stop() == 0, srv.log()
