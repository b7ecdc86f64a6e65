"""The cluster's side of the pod that tests/integration/test_kubernetes.py runs: what the
kubelet's probes, a client of the Service, Prometheus and ``kubectl port-forward`` do to it.

Run inside one of the test's network namespaces (``python cluster_client.py < calls.json``):
reads a JSON list of calls from stdin, makes them in order, each bounded by its own deadline,
and prints a JSON list with one result per call:

- ``{"call": "health", "target": "ip:port", "service": name, "wait_s": s}``: a ``grpc.health.v1``
  Check, as the kubelet's gRPC probe (no key), repeated until SERVING or ``wait_s`` passes:
  ``{"status": "SERVING"}`` (the last status, or ``{"code": ...}``).
- ``{"call": "predict", "target", "model", "data", "key"}``: ``Predictions`` with
  ``authorization: Bearer <key>`` (none when ``key`` is null): ``{"prediction": text}`` or
  ``{"code": "UNAUTHENTICATED"}``.
- ``{"call": "model_infer", "target", "request"}``: the Open Inference Protocol's ``ModelInfer``
  (KServe's ``inference.GRPCInferenceService``) with ``request`` as protobuf JSON: the answer as
  protobuf JSON, or ``{"code": ...}``.
- ``{"call": "list_models", "target", "key"}``: the management API's ``ListModels``:
  ``{"models": [names]}`` or ``{"code": ...}``.
- ``{"call": "http", "url", "method", "headers", "body"}``: ``{"status": int, "body": text}``
  (``status`` None and an ``error`` when no connection could be made).
- ``{"call": "connect", "host", "port"}``: whether a TCP connection is accepted:
  ``{"connected": bool, "error": text}``.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_service._proto import (
    grpc_predict_v2_pb2,
    grpc_predict_v2_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    management_pb2,
    management_pb2_grpc,
)

#: Seconds one call may take (a health call waits up to its own ``wait_s`` on top).
CALL_TIMEOUT_S = 20.0


def _metadata(key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] if key else []


def health(target: str, service: str, wait_s: float = 0.0) -> dict[str, Any]:
    """A grpc.health.v1 Check of ``service``, repeated until SERVING or ``wait_s`` s have passed."""
    deadline = time.monotonic() + wait_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S).status
                result: dict[str, Any] = {"status": health_pb2.HealthCheckResponse.ServingStatus.Name(status)}
            except grpc.RpcError as err:
                result = {"code": err.code().name, "details": err.details()}
            if result.get("status") == "SERVING" or time.monotonic() >= deadline:
                return result
            time.sleep(0.2)


def predict(target: str, model: str, data: str, key: str | None) -> dict[str, Any]:
    """One ``Predictions`` call with the given key (or none)."""
    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name=model, input={"data": data.encode()})
        try:
            reply = stub.Predictions(request, timeout=CALL_TIMEOUT_S, metadata=_metadata(key))
        except grpc.RpcError as err:
            return {"code": err.code().name, "details": err.details()}
        return {"prediction": reply.prediction.decode(errors="replace")}


def model_infer(target: str, request: dict[str, Any]) -> dict[str, Any]:
    """One ``ModelInfer`` call (no key)."""
    message = json_format.ParseDict(request, grpc_predict_v2_pb2.ModelInferRequest())
    with grpc.insecure_channel(target) as channel:
        stub = grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            reply = stub.ModelInfer(message, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            return {"code": err.code().name, "details": err.details()}
        answer: dict[str, Any] = json_format.MessageToDict(reply, preserving_proto_field_name=True)
        return answer


def list_models(target: str, key: str | None) -> dict[str, Any]:
    """The management API's ``ListModels`` (names only)."""
    with grpc.insecure_channel(target) as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        try:
            reply = stub.ListModels(management_pb2.ListModelsRequest(limit=100), timeout=CALL_TIMEOUT_S,
                                    metadata=_metadata(key))
        except grpc.RpcError as err:
            return {"code": err.code().name, "details": err.details()}
        return {"models": [m["modelName"] for m in json.loads(reply.msg)["models"]]}


def http(url: str, method: str = "GET", headers: dict[str, str] | None = None, body: str | None = None,
         ) -> dict[str, Any]:
    """One HTTP/1.1 request (no proxies)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, method=method, headers=headers or {},
                                     data=body.encode() if body is not None else None)
    try:
        with opener.open(request, timeout=CALL_TIMEOUT_S) as response:
            return {"status": response.status, "body": response.read().decode(errors="replace")}
    except urllib.error.HTTPError as err:
        return {"status": err.code, "body": err.read().decode(errors="replace")}
    except (urllib.error.URLError, OSError) as exc:
        return {"status": None, "body": "", "error": str(getattr(exc, "reason", exc))}


def connect(host: str, port: int) -> dict[str, Any]:
    """Whether ``host:port`` accepts a TCP connection."""
    try:
        with socket.create_connection((host, port), timeout=CALL_TIMEOUT_S):
            return {"connected": True, "error": ""}
    except OSError as exc:
        return {"connected": False, "error": str(exc)}


CALLS = {"health": health, "predict": predict, "model_infer": model_infer, "list_models": list_models, "http": http,
         "connect": connect}


def main() -> int:
    """Make the calls read from stdin; print their results."""
    results = []
    for call in json.load(sys.stdin):
        args = dict(call)
        results.append(CALLS[args.pop("call")](**args))
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
