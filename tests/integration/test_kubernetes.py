"""deploy/kubernetes: the manifests validate, and their probes match what the server serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import javaproperties
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ROOT, ServerProcess
from inference_service._proto import inference_pb2, inference_pb2_grpc

DEPLOY = ROOT / "deploy" / "kubernetes"


def _docs() -> dict[str, dict]:
    docs = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def test_manifests_validate_offline():
    files = [str(p) for p in sorted(DEPLOY.glob("*.yaml"))]
    proc = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", *files],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == len(files)


def _non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family.name == "AF_INET" and not addr.address.startswith("127."):
                return addr.address
    return None


def test_probes_match_the_server_configured_by_the_manifests(store, tmp_path):
    docs = _docs()
    props = javaproperties.loads(docs["ConfigMap"]["data"]["config.properties"])
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert docs["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] \
        > float(props["drain_timeout_sec"])
    probes = {name: container[name]["grpc"] for name in ("livenessProbe", "readinessProbe", "startupProbe")}
    for probe in probes.values():
        assert probe["port"] == int(props["grpc_inference_port"])
    assert props["grpc_inference_address"] == "0.0.0.0"
    assert docs["Service"]["spec"]["ports"][0]["port"] == int(props["grpc_inference_port"])

    # the same config, with the test's model store and a free port, token authorization on
    props.update({"model_store": str(store), "load_models": "echo.mar", "grpc_inference_port": "0",
                  "grpc_management_port": "0"})
    config = tmp_path / "config.properties"
    config.write_text(javaproperties.dumps(props))
    env_keys = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"] if "valueFrom" in e}
    assert env_keys == {"INFERENCE_SERVICE_INFERENCE_KEY": "inference",
                        "INFERENCE_SERVICE_MANAGEMENT_KEY": "management"}
    shared = {"INFERENCE_SERVICE_INFERENCE_KEY": "k8s-shared-inference-key-0123456789",
              "INFERENCE_SERVICE_MANAGEMENT_KEY": "k8s-shared-management-key-0123456789"}
    srv = ServerProcess(tmp_path / "work", store, ["--ts-config", str(config)], env=shared)
    try:
        host = _non_loopback_ipv4() or "127.0.0.1"
        channel = grpc.insecure_channel(f"{host}:{srv.inference_port}")
        health = health_pb2_grpc.HealthStub(channel)
        srv.wait_workers("echo", 1)
        for name, probe in probes.items():  # probes need no token
            status = health.Check(health_pb2.HealthCheckRequest(service=probe["service"]), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, name
        # token authorization is on: no key, no inference; the Secret's key works
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"k8s"})
        with pytest.raises(grpc.RpcError) as err:
            stub.Predictions(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = [("authorization", f"Bearer {shared['INFERENCE_SERVICE_INFERENCE_KEY']}")]
        assert stub.Predictions(request, timeout=10, metadata=metadata).prediction == b"k8s"
        channel.close()
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("path", ["Dockerfile"])
def test_container_recipe_runs_as_non_root_without_hub_access(path):
    text = (ROOT / path).read_text()
    assert "USER 10001" in text and "HF_HUB_OFFLINE=1" in text and "-c constraints.txt" in text
