"""deploy/kserve and deploy/gateway: every object validates against its CRD's schema, taken from
the KServe, KEDA and Inference Extension releases (tests/data/crds), and the objects agree with
each other, with KServe's kserve-torchserve runtime and with the server's configuration."""

from __future__ import annotations

import copy
import gzip
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import javaproperties
import jsonschema
import pytest
import yaml

from conftest import ROOT
from inference_service.config import Settings, apply_properties, read_properties

CRDS = ROOT / "tests" / "data" / "crds"
KSERVE = ROOT / "deploy" / "kserve"
GATEWAY = ROOT / "deploy" / "gateway"
#: the plugin types of the inferencepool chart's default EndpointPickerConfig (v1.5.0, epplib's _config.yaml)
EPP_PLUGIN_TYPES = {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "metrics-data-source",
                    "core-metrics-extractor"}


def _crd_text(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` refusing fields it does not declare (the API server's strict field validation;
    a CRD schema prunes them silently), except where it preserves unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """``(apiVersion, kind)`` -> the strict openAPIV3Schema of every served version of every CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml*")):
        crd = yaml.load(_crd_text(path), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 2 MB: libyaml
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                out[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return out


SCHEMAS = _schemas()


def _objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for directory in (KSERVE, GATEWAY):
        for path in sorted(directory.rglob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc and "apiVersion" in doc:  # epp-values.yaml holds Helm values, not an object
                    yield path, doc


def _validate(doc: dict[str, Any]) -> list[str]:
    schema = SCHEMAS[(doc["apiVersion"], doc["kind"])]
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_crd_files_are_the_release_files() -> None:
    table = (CRDS / "README.md").read_text()
    files = sorted(CRDS.glob("*.yaml*"))
    assert len(files) == 4
    for path in files:
        row = re.search(rf"^\| `{re.escape(path.name)}` \|.*\| `([0-9a-f]{{64}})` \|$", table, re.M)
        assert row, path.name
        assert hashlib.sha256(_crd_text(path)).hexdigest() == row[1], f"{path.name} differs from the release's"


def test_every_object_validates_against_its_crd() -> None:
    kinds = []
    for path, doc in _objects():
        assert (doc["apiVersion"], doc["kind"]) in SCHEMAS, f"{path}: no CRD of {doc['apiVersion']} {doc['kind']}"
        assert _validate(doc) == [], path
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["ClusterServingRuntime", "InferencePool", "InferenceService", "InferenceService",
                             "ScaledObject"]


@pytest.mark.parametrize(("kind", "change", "fragment"), [
    ("ClusterServingRuntime", lambda d: d["spec"]["containers"][0].update(argz=["x"]), "'argz' was unexpected"),
    ("ClusterServingRuntime", lambda d: d["spec"]["supportedModelFormats"][0].update(priority="3"),
     "'3' is not of type 'integer'"),
    ("InferenceService", lambda d: d["spec"]["predictor"]["model"].update(modelFormat={}), "'name' is a required"),
    ("ScaledObject", lambda d: d["spec"].pop("scaleTargetRef"), "'scaleTargetRef' is a required property"),
    ("InferencePool", lambda d: d["spec"]["targetPorts"][0].update(number=0), "0 is less than the minimum of 1"),
])
def test_a_broken_object_is_refused(kind: str, change: Any, fragment: str) -> None:
    doc = copy.deepcopy(next(d for _, d in _objects() if d["kind"] == kind))
    change(doc)
    assert any(fragment in error for error in _validate(doc)), _validate(doc)


def _load(path: Path) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return doc


def test_the_runtime_is_kserve_torchserve_with_this_image() -> None:
    ours = _load(KSERVE / "clusterservingruntime.yaml")
    theirs = _load(ROOT / "tests" / "data" / "kserve" / "kserve-torchserve.yaml")
    (container,), (their_container,) = ours["spec"]["containers"], theirs["spec"]["containers"]
    assert container["args"] == their_container["args"]  # the same command line
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TS_SERVICE_ENVELOPE"] == "{{.Labels.serviceEnvelope}}" == their_container["env"][0]["value"]
    assert env["TS_GRPC_INFERENCE_ADDRESS"] == "0.0.0.0"
    assert ours["metadata"]["annotations"]["serving.kserve.io/server-type"] == "torchserve"
    assert ours["spec"]["annotations"] == theirs["spec"]["annotations"]  # prometheus.kserve.io/port 8082, /metrics
    assert set(ours["spec"]["protocolVersions"]) == {"v1", "v2", "grpc-v2"}
    (fmt,), (their_fmt,) = ours["spec"]["supportedModelFormats"], theirs["spec"]["supportedModelFormats"]
    # opt-in (issue 49 item 7): applying it takes no pytorch InferenceService over from kserve-torchserve
    assert (fmt["name"], fmt["version"], fmt["autoSelect"]) == ("pytorch", "1", False) and "priority" not in fmt
    assert their_fmt["autoSelect"] is True
    for name in ("inferenceservice-torchserve.yaml", "inferenceservice-llm.yaml"):  # the samples name it
        assert _load(KSERVE / name)["spec"]["predictor"]["model"]["runtime"] == ours["metadata"]["name"]
    # the ports of KServe's sample config.properties: HTTP (both APIs) and gRPC inference, named for KServe
    sample = javaproperties.loads((ROOT / "tests" / "data" / "kserve" / "v2" / "config.properties").read_text())
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http1": urlparse(sample["inference_address"]).port, "h2c": int(sample["grpc_inference_port"])}
    assert urlparse(sample["metrics_address"]).port == int(ours["spec"]["annotations"]["prometheus.kserve.io/port"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == ports["h2c"]
    assert container["readinessProbe"]["grpc"]["service"] == "org.pytorch.serve.grpc.inference.InferenceAPIsService"
    for name in ("inferenceservice-torchserve.yaml", "inferenceservice-llm.yaml"):
        model = _load(KSERVE / name)["spec"]["predictor"]["model"]
        assert (model["modelFormat"]["name"], model["runtime"]) == ("pytorch", ours["metadata"]["name"])


def test_the_llm_objects_agree() -> None:
    isvc = _load(KSERVE / "inferenceservice-llm.yaml")
    name = isvc["metadata"]["name"]
    props = read_properties(KSERVE / "smollm2" / "config" / "config.properties")
    settings = Settings()
    assert apply_properties(settings, props, "smollm2 config.properties") == []  # every key understood
    assert settings.model_snapshot is not None and list(settings.model_snapshot["models"]) == [name]
    assert settings.enable_envvars_config  # for the runtime's TS_* variables
    # KEDA scales the Deployment KServe makes of the predictor (Standard mode), KServe's HPA off
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "Standard"
    assert annotations["serving.kserve.io/autoscalerClass"] == "external"
    scaled = _load(KSERVE / "keda-scaledobject.yaml")
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{name}-predictor"}
    assert scaled["spec"]["scaleTargetRef"] == target
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (
        isvc["spec"]["predictor"]["minReplicas"], isvc["spec"]["predictor"]["maxReplicas"])
    queries = {t["name"]: t["metadata"]["query"] for t in scaled["spec"]["triggers"]}
    assert queries == {"waiting-requests": f'sum(vllm:num_requests_waiting{{model_name="{name}"}})',
                       "kv-cache-usage": f'sum(vllm:kv_cache_usage_perc{{model_name="{name}"}})'}
    assert all(t["type"] == "prometheus" and t["metricType"] == "AverageValue" for t in scaled["spec"]["triggers"])
    # the InferencePool is what the chart renders from the values for the release name
    values = yaml.safe_load((GATEWAY / "epp-values.yaml").read_text())
    pool = _load(GATEWAY / "inferencepool.yaml")
    rendered = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": name},
                "spec": {"targetPorts": values["inferencePool"]["targetPorts"], "appProtocol": "http",
                         "selector": {"matchLabels": values["inferencePool"]["modelServers"]["matchLabels"]},
                         "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002},
                                               "failureMode": "FailOpen"}}}
    assert pool == rendered
    assert pool["spec"]["selector"]["matchLabels"] == {"serving.kserve.io/inferenceservice": name}
    assert pool["spec"]["targetPorts"] == [{"number": settings.http_port}]  # OpenAI's routes
    assert values["inferenceExtension"]["flags"]["model-server-metrics-port"] == settings.metrics_port
    assert values["inferencePool"]["modelServerType"] == "vllm"
    # the endpoint picker's plugins: the chart's types, every profile entry a declared plugin
    file = values["inferenceExtension"]["pluginsConfigFile"]
    config = yaml.safe_load(values["inferenceExtension"]["pluginsCustomConfig"][file])
    assert (config["apiVersion"], config["kind"]) == ("inference.networking.x-k8s.io/v1alpha1", "EndpointPickerConfig")
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    assert {p["type"] for p in config["plugins"]} <= EPP_PLUGIN_TYPES
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    assert refs and set(refs) <= declared
