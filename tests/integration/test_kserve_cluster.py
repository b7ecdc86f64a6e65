"""An InferenceService on deploy/kserve's ClusterServingRuntime, played out (``playout.py``): two
replicas, each a pod of its own started as KServe starts the runtime's container, answer KServe's
sample requests from the cluster network and show the routing gauges on their metrics port.

Each pod's container runs the runtime's ``args`` (the image has no ENTRYPOINT) followed by the
InferenceService's (inferenceservice-torchserve.yaml), with the runtime's ``env`` as KServe fills
its template (``serviceEnvelope`` ``kserve`` for protocol v1, ``kservev2`` for v2) and KServe's
``PROTOCOL_VERSION``, as pid 1 of a pid namespace of its own. ``/mnt/models`` (what KServe's
storage initializer downloads) is a temporary directory holding the model store and KServe's
sample config.properties (tests/data/kserve) as a file: its ports and addresses as written, its
``model_snapshot`` with one model added, ``llmstats`` (tests/handlers/llm_stats_handler.py, which
reports serving statistics as the LLM handler does), so that the routing gauges have a model.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kserve_files import KSERVE, build_mnist, console_script, expected_digit, mnist_weights, v1_tensor, v2_tensor
from playout import NAMESPACES_NEEDED, POD_IPS, Cluster, namespaces_usable
from prometheus_client.parser import text_string_to_metric_families

from conftest import ROOT, _alive, _descendants, build_mar, wait_for

pytestmark = pytest.mark.external

DEPLOY = ROOT / "deploy" / "kserve"
#: KServe's serviceEnvelope label for a TorchServe runtime, by the InferenceService's protocolVersion
ENVELOPES = {"v1": "kserve", "v2": "kservev2"}
MOUNT = "/mnt/models"
START_TIMEOUT_S = 120.0


def _load(path: Path) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return doc


def _config(protocol: str, mount: Path) -> str:
    """KServe's sample config.properties of ``protocol``, ``llmstats`` added to its model_snapshot and
    the volume path mapped; nothing else changes."""
    lines = []
    for line in (KSERVE / protocol / "config.properties").read_text().splitlines():
        if line.startswith("model_snapshot="):
            snapshot = json.loads(line.partition("=")[2])
            snapshot["models"]["llmstats"] = {"1.0": {"defaultVersion": True, "marName": "llmstats.mar",
                                                      "minWorkers": 1, "maxWorkers": 1}}
            snapshot["modelCount"] += 1
            line = "model_snapshot=" + json.dumps(snapshot, separators=(",", ":"))
        lines.append(line.replace(MOUNT, str(mount)))
    return "\n".join(lines) + "\n"


def _container(protocol: str, mount: Path, image_bin: Path, home: Path) -> tuple[list[str], dict[str, str]]:
    """The kserve-container's command line and environment, as KServe builds them for the pod."""
    runtime = _load(DEPLOY / "clusterservingruntime.yaml")
    (container,) = runtime["spec"]["containers"]
    isvc = _load(DEPLOY / "inferenceservice-torchserve.yaml")
    argv = [a.replace(MOUNT, str(mount)) for a in container["args"] + isvc["spec"]["predictor"]["model"]["args"]]
    argv[0] = shutil.which(argv[0], path=str(image_bin)) or argv[0]  # the image's torchserve
    env = {"PATH": f"{image_bin}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "PROTOCOL_VERSION": protocol}
    for item in container["env"]:
        env[item["name"]] = item["value"].replace("{{.Labels.serviceEnvelope}}", ENVELOPES[protocol])
    if os.environ.get("PYTHONPATH"):  # the image's code is the tree under test, wherever it is
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return argv, env


def _ready(status_file: Path, proc: subprocess.Popen[str], log: Path) -> dict[str, Any] | None:
    assert proc.poll() is None, f"the pod's container exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
    try:
        status: dict[str, Any] = json.loads(status_file.read_text())
    except (OSError, ValueError):
        return None
    models = status.get("models", {})
    assert not [m for m in models.values() if m["state"] == "failed"], log.read_text()[-3000:]
    return status if len(models) == 2 and all(m["state"] == "ready" for m in models.values()) else None


def _calls(protocol: str, ip: str, runtime: dict[str, Any]) -> list[dict[str, Any]]:
    """What the cluster sends a replica: the readiness probe, the protocol's sample requests over HTTP
    and gRPC, the management API on the shared port and the Prometheus scrape."""
    (container,) = runtime["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe = container["readinessProbe"]["grpc"]
    http, grpc_target = f"http://{ip}:{ports['http1']}", f"{ip}:{ports['h2c']}"
    calls: list[dict[str, Any]] = [{"call": "health", "target": f"{ip}:{probe['port']}", "service": probe["service"],
                                    "wait_s": 30}]
    if protocol == "v1":
        body = (KSERVE / "v1" / "mnist.json").read_text()
        calls += [{"call": "http", "url": f"{http}/v1/models/mnist:predict", "method": "POST", "body": body,
                   "headers": {"Content-Type": "application/x-www-form-urlencoded"}},  # curl -d, as KServe's README
                  {"call": "predict", "target": grpc_target, "model": "mnist", "data": body, "key": None}]
    else:
        calls += [{"call": "http", "url": f"{http}/v2/models/mnist/infer", "method": "POST",
                   "body": (KSERVE / "v2" / "mnist_v2.json").read_text(),
                   "headers": {"Content-Type": "application/json"}},
                  {"call": "model_infer", "target": grpc_target,
                   "request": json.loads((KSERVE / "v2" / "mnist_v2_tensor_grpc.json").read_text())}]
    metrics = runtime["spec"]["annotations"]
    calls += [{"call": "http", "url": f"{http}/models"},
              {"call": "http", "url": f"http://{ip}:{metrics['prometheus.kserve.io/port']}"
                                     f"{metrics['prometheus.kserve.io/path']}"}]
    return calls


def _digit(protocol: str, http_answer: dict[str, Any], grpc_answer: dict[str, Any]) -> int:
    """The digit of the HTTP answer, checked equal to the gRPC one's."""
    assert http_answer["status"] == 200, http_answer
    body = json.loads(http_answer["body"])
    if protocol == "v1":
        assert json.loads(grpc_answer["prediction"]) == body, grpc_answer
        (digit,) = body["predictions"]
        return int(digit)
    ((http_output,), (grpc_output,)) = body["outputs"], grpc_answer["outputs"]
    assert http_output["datatype"] == grpc_output["datatype"] == "INT64", (body, grpc_answer)
    assert [int(v) for v in grpc_output["contents"]["int64_contents"]] == http_output["data"], grpc_answer
    (digit,) = http_output["data"]
    return int(digit)


@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_two_replicas_answer_from_the_cluster_network(protocol: str, tmp_path: Path) -> None:
    assert namespaces_usable(), NAMESPACES_NEEDED
    runtime = _load(DEPLOY / "clusterservingruntime.yaml")
    weights = mnist_weights(tmp_path / "mnist_cnn.pt")
    built = tmp_path / "built"
    built.mkdir()
    build_mnist(built, weights)
    build_mar(built, "llmstats", "llm_stats_handler:handle")
    image_bin = tmp_path / "image" / "bin"
    console_script("torchserve", image_bin)  # pip's script for [project.scripts], as the image has it
    cluster = Cluster(tmp_path, {}, pods=2)
    try:
        pods = []
        for index in range(2):
            root = tmp_path / f"pod{index}"
            mount, home = root / "mnt" / "models", root / "home" / "serve"
            shutil.copytree(built, mount / "model-store")
            (mount / "config").mkdir(parents=True)
            (mount / "config" / "config.properties").write_text(_config(protocol, mount))
            home.mkdir(parents=True)
            argv, env = _container(protocol, mount, image_bin, home)
            log = root / "container.log"
            with open(log, "w") as out:
                proc = cluster.start(cluster.in_container(argv, home, index), env=env, stdout=out,
                                     stderr=subprocess.STDOUT)
            pods.append((proc, home, log))
        for proc, home, log in pods:
            status = wait_for(lambda: _ready(home / ".inference_service" / "status.json", proc, log),  # noqa: B023
                              START_TIMEOUT_S, 0.1, "the replica's startup models ready")
            assert status["pid"] == 1  # `torchserve --start` as the container's main process stays in front
            assert status["http_port"] == status["http_management_port"] == 8085  # KServe's one address

        want = expected_digit(weights, v1_tensor() if protocol == "v1" else v2_tensor())
        for index, (_, _, log) in enumerate(pods):
            health, http_answer, grpc_answer, models, scrape = cluster.calls(_calls(protocol, POD_IPS[index], runtime))
            assert health == {"status": "SERVING"}, (health, log.read_text()[-3000:])
            assert _digit(protocol, http_answer, grpc_answer) == want, index
            assert models["status"] == 200
            assert sorted(m["modelName"] for m in json.loads(models["body"])["models"]) == ["llmstats", "mnist"]
            assert scrape["status"] == 200
            routing = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                       for family in text_string_to_metric_families(scrape["body"]) for sample in family.samples
                       if sample.name.startswith("vllm:")}
            llmstats = (("model_name", "llmstats"),)
            assert routing == {  # llmstats at rest (capacity 1000 tokens); mnist, an image classifier, has none
                ("vllm:num_requests_waiting", llmstats): 0.0, ("vllm:num_requests_running", llmstats): 0.0,
                ("vllm:kv_cache_usage_perc", llmstats): 0.0,
                ("vllm:cache_config_info", (("block_size", "16"), *llmstats, ("num_gpu_blocks", "62"))): 1.0}

        # SIGTERM to each container's main process: the server drains and the container exits 0
        for proc, _, log in pods:
            (main,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()  # unshare's child
            workers = _descendants(int(main))
            assert workers
            os.kill(int(main), signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()[-3000:]
            wait_for(lambda: not any(_alive(p) for p in workers), 10, 0.05, "workers exit with the server")  # noqa: B023
    finally:
        cluster.close()

