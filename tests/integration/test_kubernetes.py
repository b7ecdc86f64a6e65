"""deploy/kubernetes: the manifests validate, agree with each other, and the pod they describe
serves through its Service, is scraped, and drains on SIGTERM.

No cluster runs here (no container runtime, and no kubelet or API server in the package
registries this machine reaches), so the end-to-end test plays the cluster's part with network
namespaces of its own (``playout.py``: ``unshare``, ``nsenter``, ``ip``):

- the cluster network: a namespace holding the model repository's Service address
  (:data:`REPOSITORY_IP`, an HTTP server serving an archive) and the node's end of a veth link to
  the pod; the kubelet's probes, the Service's traffic and Prometheus' scrape come from here
  (``cluster_client.py``);
- the pod: a namespace of its own (network and mounts) with :data:`POD_IP` on ``eth0``, an
  ``/etc/hosts`` naming the repository as cluster DNS would, where the initContainer and then the
  server run: each container's ``command`` + ``args`` and ``env`` exactly as the Deployment gives
  them (``python`` and ``inference-service`` are the project's virtualenv's, as in the image),
  with the ConfigMap written as files into a temporary directory standing in for its volume and
  the emptyDir a temporary directory (volume paths in arguments and config values are mapped onto
  them, nothing else changes; ports, addresses and ``allowed_urls`` stay as configured).

A server that bound a port to loopback only cannot be reached from the cluster namespace: the
calls there prove the binds a Service needs. The management API is checked to be reachable only
from inside the pod (what ``kubectl port-forward`` does).
"""

from __future__ import annotations

import copy
import filecmp
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import javaproperties
import pytest
import yaml
from playout import NAMESPACES_NEEDED, POD_IPS, REPOSITORY_IP, Cluster, namespaces_usable, read_line

from conftest import ROOT, _alive, _descendants, build_mar, wait_for
from inference_service.archive.fetch import UrlPolicy

DEPLOY = ROOT / "deploy" / "kubernetes"
BIN = Path(sys.executable).parent

POD_IP = POD_IPS[0]  #: the pod's address on its eth0
#: The stand-in for the inference-service-keys Secret (``kubectl create secret generic ...``).
SECRET = {"inference": "k8s-shared-inference-key-0123456789",
          "management": "k8s-shared-management-key-0123456789"}
#: Seconds the pod gets to serve (startup probe: periodSeconds x failureThreshold is 120).
START_TIMEOUT_S = 120.0


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _docs() -> dict[str, dict[str, Any]]:
    """The resources ``kubectl apply -f deploy/kubernetes/`` creates, by kind."""
    return {doc["kind"]: doc for path in sorted(DEPLOY.glob("*.yaml")) for doc in _load(path)}


def _props() -> dict[str, str]:
    return dict(javaproperties.loads(_docs()["ConfigMap"]["data"]["config.properties"]))


def _pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def _server(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = _pod_spec(deployment)["containers"][0]
    return container


def _port_of(url: str) -> int:
    port = urlparse(url).port
    assert port is not None, url
    return port


def _all_manifests() -> list[Path]:
    return sorted(DEPLOY.rglob("*.yaml"))


@pytest.mark.parametrize("version", [None, "1.27.0"])  # the default (newest) and the oldest with gRPC probes
def test_manifests_validate_offline(version):
    files = [str(p) for p in _all_manifests()]
    cmd = [str(BIN / "kubernetes-validate"), "--strict", *(["-k", version] if version else []), *files]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kinds = [doc["kind"] for path in _all_manifests() for doc in _load(path)]
    custom = [k for k in kinds if k == "PodMonitor"]  # a CRD: no schema offline, checked below
    assert proc.stdout.count("passed") == len(kinds) - len(custom), proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout and "ERROR" not in proc.stdout, proc.stdout


def test_manifests_agree_with_each_other():
    docs = _docs()
    props = _props()
    deployment, service = docs["Deployment"], docs["Service"]
    spec = _pod_spec(deployment)
    server = _server(deployment)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels == service["spec"]["selector"]

    # binds: inference (gRPC, HTTP) and metrics on every interface, management on loopback
    assert props["grpc_inference_address"] == "0.0.0.0"
    assert urlparse(props["inference_address"]).hostname == "0.0.0.0"
    assert urlparse(props["metrics_address"]).hostname == "0.0.0.0"
    assert props["grpc_management_address"] == "127.0.0.1"
    assert urlparse(props["management_address"]).hostname == "127.0.0.1"
    assert props.get("disable_token_authorization", "false") == "false"
    assert props.get("enable_model_api", "false") == "false"
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {"grpc-inference": int(props["grpc_inference_port"]),
                     "http-inference": _port_of(props["inference_address"]),
                     "metrics": _port_of(props["metrics_address"])}
    # the Service forwards to named container ports, and to none of the management ports
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert all(p["port"] == ports[p["targetPort"]] for p in service["spec"]["ports"])
    for name in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert server[name]["grpc"]["port"] == ports["grpc-inference"], name

    # Prometheus: annotations and the PodMonitor name the metrics port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert annotations["prometheus.io/path"] == "/metrics"
    (monitor,) = _load(DEPLOY / "prometheus-operator" / "podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert monitor["spec"]["selector"]["matchLabels"] == labels
    assert [(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]] == [("metrics", "/metrics")]

    # disruptions and termination
    pdb = docs["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"] == labels
    assert pdb["spec"]["maxUnavailable"] < min(deployment["spec"]["replicas"],
                                               docs["HorizontalPodAutoscaler"]["spec"]["minReplicas"])
    pre_stop = server["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    margin = spec["terminationGracePeriodSeconds"] - float(pre_stop[1]) - float(props["drain_timeout_sec"])
    assert margin >= 5, "terminationGracePeriodSeconds must cover preStop + drain_timeout_sec + the workers' exit"

    # keys come from the Secret; the initContainer's URLs are ones allowed_urls allows
    env_keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in server["env"] if "valueFrom" in e}
    assert env_keys == {"INFERENCE_SERVICE_INFERENCE_KEY": {"name": "inference-service-keys", "key": "inference"},
                        "INFERENCE_SERVICE_MANAGEMENT_KEY": {"name": "inference-service-keys", "key": "management"}}
    (init,) = spec["initContainers"]
    assert init["image"] == server["image"]
    urls = [a.split("=", 1)[-1] if "=" in a.split("://")[0] else a for a in init["args"] if "://" in a]
    assert urls
    policy = UrlPolicy(tuple(props["allowed_urls"].split(",")))
    for url in urls:
        policy.check(url)
    for container in (init, server):
        assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]


def test_baked_models_deployment_is_the_deployment_without_the_fetch():
    """baked-models/deployment.yaml = deployment.yaml less the initContainer and the model-store volume."""
    main = copy.deepcopy(_docs()["Deployment"])
    (baked,) = _load(DEPLOY / "baked-models" / "deployment.yaml")
    spec = _pod_spec(main)
    del spec["initContainers"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "models"]
    server = _server(main)
    server["volumeMounts"] = [m for m in server["volumeMounts"] if m["name"] != "models"]
    assert _server(baked)["image"] == server["image"] + "-models"
    server["image"] = _server(baked)["image"]
    assert baked == main


def test_container_recipe():
    """The image runs as non-root without hub access; with-models bakes a model store in, the default has none."""
    text = (ROOT / "Dockerfile").read_text()
    assert "USER 10001" in text and "HF_HUB_OFFLINE=1" in text and "-c constraints.txt" in text
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    assert stages == [("python:3.11-slim", "server"), ("server", "with-models"), ("server", "with-llm"), ("server", "")]
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert {".git", ".venv", "key_file.json", ".inference_service"} <= set(ignored)
    (model_store,) = re.findall(r"^ARG MODEL_STORE=(\S+)$", text, re.M)
    copied = [model_store, "src", "requirements.txt", "constraints.txt", "pyproject.toml", "README.md",
              "scripts/build_llm_archive"]
    assert not [path for path in copied for pattern in ignored if fnmatch.fnmatch(path, pattern)]


# --- the pod, played out ------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """The cluster network and a pod (network and mount namespaces of the test's own)."""
    assert namespaces_usable(), NAMESPACES_NEEDED
    init = _pod_spec(_docs()["Deployment"])["initContainers"][0]
    names = {urlparse(a.split("=", 1)[-1] if "=" in a.split("://")[0] else a).hostname
             for a in init["args"] if "://" in a}
    made = Cluster(tmp_path, {str(name): REPOSITORY_IP for name in names})
    try:
        yield made
    finally:
        made.close()


class Pod:
    """One pod of a Deployment: its volumes as temporary directories, its containers' command lines."""

    def __init__(self, deployment: dict[str, Any], configmap: dict[str, Any], root: Path,
                 image_paths: dict[str, Path]) -> None:
        self.spec = _pod_spec(deployment)
        self.root = root
        self.volumes: dict[str, Path] = {}
        for volume in self.spec["volumes"]:
            path = root / "volumes" / volume["name"]
            path.mkdir(parents=True)
            if "configMap" in volume:
                assert volume["configMap"]["name"] == configmap["metadata"]["name"]
                for key, text in configmap["data"].items():
                    (path / key).write_text(text)
            else:
                assert set(volume) == {"name", "emptyDir"}, volume
            self.volumes[volume["name"]] = path
        self.image_paths = image_paths
        self.home = root / "home" / "serve"  # the image's WORKDIR (its writable layer)
        self.home.mkdir(parents=True)

    def mounts(self, container: dict[str, Any]) -> dict[str, Path]:
        """Container path -> the directory standing in for it (the image's, then the volumes)."""
        found = dict(self.image_paths)
        found.update({m["mountPath"]: self.volumes[m["name"]] for m in container.get("volumeMounts", [])})
        return found

    @staticmethod
    def _map(value: str, mounts: dict[str, Path]) -> str:
        for mount_path, path in mounts.items():
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(path) + value[len(mount_path):]
        return value

    def command(self, container: dict[str, Any]) -> list[str]:
        """The container's ``command`` + ``args``, volume paths mapped, the config file's too."""
        mounts = self.mounts(container)
        argv = [self._map(a, mounts) for a in container["command"] + container.get("args", [])]
        argv[0] = shutil.which(argv[0], path=str(BIN)) or argv[0]  # the image's python / inference-service
        for arg in argv:
            if arg.endswith(".properties") and Path(arg).is_file():  # paths in the config, mapped alike
                props = javaproperties.loads(Path(arg).read_text())
                Path(arg).write_text(javaproperties.dumps({k: self._map(v, mounts) for k, v in props.items()}))
        return argv

    def env(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's environment: ``env`` with Secret references resolved from :data:`SECRET`."""
        env = {"PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home)}
        if os.environ.get("PYTHONPATH"):  # the image's code is the tree under test, wherever it is
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                assert ref["name"] == "inference-service-keys"
                env[item["name"]] = SECRET[ref["key"]]
        return env


def _bake(context: Path, image_root: Path) -> None:
    """What ``docker build --target with-models`` adds to the image: the with-models stage's
    ``COPY ${MODEL_STORE}/ /models/``, with the ARG's default, from ``context`` into ``image_root``."""
    stage = re.search(r"^FROM server AS with-models\n(.*?)(?=^FROM |\Z)", (ROOT / "Dockerfile").read_text(),
                      re.M | re.S)
    assert stage, "the Dockerfile has no with-models stage"
    build_args = dict(re.findall(r"^ARG (\w+)=(\S+)$", stage[1], re.M))
    copies = re.findall(r"^COPY (?:--chown=\S+ )?(\S+) (\S+)$", stage[1], re.M)
    assert copies, stage[1]
    for source, target in copies:
        source = re.sub(r"\$\{(\w+)\}", lambda m: build_args[m[1]], source)
        shutil.copytree(context / source, image_root / target.lstrip("/"), dirs_exist_ok=True)


def _wait_ready(status_file: Path, proc: subprocess.Popen[str], log: Path) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()}"
        try:
            status: dict[str, Any] = json.loads(status_file.read_text())
        except (OSError, ValueError):
            return None
        models = status.get("models", {})
        failed = [m for m in models.values() if m["state"] == "failed"]
        assert not failed, f"{failed}\n{log.read_text()}"
        return status if models and all(m["state"] == "ready" for m in models.values()) else None

    return wait_for(ready, START_TIMEOUT_S, 0.1, "every startup model ready")


@pytest.mark.external  # a cluster played out in network namespaces
@pytest.mark.parametrize("store_from", ["init-container", "baked-image"])
def test_the_pod_serves_through_its_service_and_drains(cluster: Cluster, store: Path, tmp_path: Path,
                                                        store_from: str) -> None:
    docs = _docs()
    if store_from == "init-container":
        deployment = docs["Deployment"]
    else:
        (deployment,) = _load(DEPLOY / "baked-models" / "deployment.yaml")
    spec = _pod_spec(deployment)
    server = _server(deployment)
    init = _pod_spec(docs["Deployment"])["initContainers"][0]
    url = next(a for a in init["args"] if "://" in a)
    archive = Path(urlparse(url).path).name
    model = archive.removesuffix(".mar")

    image_paths = {}
    if store_from == "baked-image":  # the archive in the build context's model store, copied in
        context = tmp_path / "context"
        (context / "model_store").mkdir(parents=True)
        build_mar(context / "model_store", model, "echo_handler.py")
        _bake(context, tmp_path / "image")
        image_paths["/models"] = tmp_path / "image" / "models"
        assert (image_paths["/models"] / archive).is_file()
    pod = Pod(deployment, docs["ConfigMap"], tmp_path / "pod", image_paths)

    if store_from == "init-container":
        # the model repository: an HTTP server in the cluster serving the archive at the URL's path
        repository = tmp_path / "repository"
        served = repository / urlparse(url).path.lstrip("/")
        served.parent.mkdir(parents=True)
        build_mar(served.parent, model, "echo_handler.py")
        host_port = urlparse(url).port or 80
        http = cluster.start(cluster.in_network([sys.executable, "-u", "-m", "http.server", str(host_port),
                                                 "--bind", REPOSITORY_IP, "--directory", str(repository)]),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert "Serving HTTP" in read_line(http, 30, "model repository")
        assert [c["name"] for c in spec["initContainers"]] == ["fetch-models"]
        fetch = subprocess.run(cluster.in_pod(pod.command(init), pod.home), env=pod.env(init), capture_output=True,
                               text=True, timeout=120, check=False)
        assert fetch.returncode == 0, fetch.stdout + fetch.stderr
        assert filecmp.cmp(pod.volumes["models"] / archive, served, shallow=False)
        assert sorted(p.name for p in pod.volumes["models"].iterdir()) == [archive]  # no download left over

    # the server container, exactly as the Deployment starts it
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = cluster.start(cluster.in_pod(pod.command(server), pod.home), env=pod.env(server), stdout=out,
                             stderr=subprocess.STDOUT)
    status_file = pod.home / ".inference_service" / "status.json"
    status = _wait_ready(status_file, proc, log)
    assert status["pid"] == proc.pid
    assert list(status["models"]) == [archive]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert (status["inference_address"], status["inference_port"]) == ("0.0.0.0", ports["grpc-inference"])
    assert (status["http_address"], status["http_port"]) == ("0.0.0.0", ports["http-inference"])
    assert (status["metrics_address"], status["metrics_port"]) == ("0.0.0.0", ports["metrics"])
    assert status["management_address"] == "127.0.0.1"
    if status.get("http_management_port") is not None:
        assert status["http_management_address"] == "127.0.0.1"
    assert json.loads(log.read_text().splitlines()[-1])["level"]  # log_format=json: one object a line

    # the kubelet's probes, at the pod IP, no key
    probes = [server[name]["grpc"] for name in ("startupProbe", "livenessProbe", "readinessProbe")]
    calls: list[dict[str, Any]] = [{"call": "health", "target": f"{POD_IP}:{p['port']}", "service": p["service"],
                                    "wait_s": 30} for p in probes]
    # the Service: each port goes to the pod IP at its target port
    target = {p["name"]: ports[p["targetPort"]] for p in docs["Service"]["spec"]["ports"]}
    grpc_target = f"{POD_IP}:{target['grpc-inference']}"
    predictions = f"http://{POD_IP}:{target['http-inference']}/predictions/{model}"
    plain = {"Content-Type": "text/plain"}
    bearer = {**plain, "Authorization": f"Bearer {SECRET['inference']}"}
    calls += [
        {"call": "predict", "target": grpc_target, "model": model, "data": "k8s", "key": None},
        {"call": "predict", "target": grpc_target, "model": model, "data": "k8s", "key": SECRET["inference"]},
        {"call": "http", "url": predictions, "method": "POST", "body": "via http", "headers": plain},
        {"call": "http", "url": predictions, "method": "POST", "body": "via http", "headers": bearer},
    ]
    # Prometheus: through the Service's metrics port, the pod annotations and the PodMonitor's port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    (monitor,) = _load(DEPLOY / "prometheus-operator" / "podmonitor.yaml")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    scrapes = [f"http://{POD_IP}:{target['metrics']}/metrics",
               f"http://{POD_IP}:{annotations['prometheus.io/port']}{annotations['prometheus.io/path']}",
               f"http://{POD_IP}:{ports[endpoint['port']]}{endpoint['path']}"]
    calls += [{"call": "http", "url": u} for u in scrapes]
    # the management APIs are not reachable from the cluster
    management_ports = [status["management_port"], *([status["http_management_port"]]
                                                      if status.get("http_management_port") else [])]
    calls += [{"call": "connect", "host": POD_IP, "port": p} for p in management_ports]

    results = cluster.calls(calls)
    for call, result in zip(calls[:3], results[:3], strict=True):
        assert result == {"status": "SERVING"}, (call, result, log.read_text()[-3000:])
    no_key, with_key, http_no_key, http_with_key = results[3:7]
    assert no_key["code"] == "UNAUTHENTICATED"
    assert with_key == {"prediction": "k8s"}
    assert http_no_key["status"] == 401
    assert (http_with_key["status"], http_with_key["body"]) == (200, "via http")
    for scrape in results[7:10]:
        assert scrape["status"] == 200
        counts = re.findall(rf'^ts_inference_requests_total{{[^}}]*model_name="{model}"[^}}]*}} (\S+)$',
                            scrape["body"], re.M)
        assert counts and float(counts[0]) >= 2, scrape["body"][:2000]
    for port, result in zip(management_ports, results[10:], strict=True):
        assert not result["connected"], f"management port {port} is reachable from the cluster"

    # inside the pod (kubectl port-forward connects there) the management API answers its key
    (listed,) = cluster.calls([{"call": "list_models", "target": f"127.0.0.1:{status['management_port']}",
                                "key": SECRET["management"]}], from_pod=pod.home)
    assert listed == {"models": [model]}

    # termination: after preStop the kubelet sends SIGTERM; the server drains and exits 0 in time
    workers = _descendants(proc.pid)
    assert workers
    grace = spec["terminationGracePeriodSeconds"] - float(server["lifecycle"]["preStop"]["exec"]["command"][1])
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(grace) == 0, log.read_text()[-3000:]
    assert time.monotonic() - started < grace
    assert not status_file.exists()
    wait_for(lambda: not any(_alive(p) for p in workers), 10, 0.05, "workers exit with the server")
