"""Labels and ids agree across the server's outputs: one ``model_version`` per served version in
every metric family and access line, the client's ``x-request-id`` in TorchServe's metric lines,
``/v1/models`` naming only the models the OpenAI door can serve, and a form body at a JSON door
refused with a 400 that says so."""

from __future__ import annotations

import http.client
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ServerProcess, build_mar, read_key, wait_for
from inference_service._proto import inference_pb2

ACCESS = re.compile(r"INFO inference_service\.access: (.+?) model=(\S+) version=(\S+) .* request_id=(\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def srv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """echo, metered (handler metrics, logged) and router (a handler that takes the LLM request)."""
    build_mar(store, "metered", "metrics_handler.py")
    build_mar(store, "router", "route_handler.py")
    server = ServerProcess(tmp_path_factory.mktemp("labels"), store,
                           ["--workers-per-model", "1", "--models", "echo=echo.mar", "metered=metered.mar",
                            "router=router.mar"])
    try:
        for name in ("echo", "metered", "router"):
            server.wait_workers(name, 1)
        yield server
    finally:
        assert server.stop() == 0, server.log()


def call(server: ServerProcess, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.status["http_port"], timeout=30)
    try:
        conn.request(method, path, body=body, headers={
            "Authorization": f"Bearer {read_key(server.key_file, 'inference')}", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def access_lines(server: ServerProcess) -> list[tuple[str, ...]]:
    return [m.groups() for line in server.log().splitlines() if (m := ACCESS.search(line))]


def test_one_model_version_per_served_version_in_metrics_and_access_lines(srv):
    request = inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"x"})
    assert srv.inference.Predictions(request, timeout=30).prediction == b"x"
    request.model_version = "1.0"
    assert srv.inference.Predictions(request, timeout=30).prediction == b"x"
    assert [m.prediction for m in srv.inference.StreamPredictions(request, timeout=30)] == [b"x"]
    for path in ("/predictions/echo", "/predictions/echo/1.0"):
        assert call(srv, "POST", path, b"x") == (200, b"x")
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.status['metrics_port']}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    families = {}
    for line in text.splitlines():
        labels = dict(LABEL.findall(line.split("{", 1)[1])) if "{" in line and not line.startswith("#") else {}
        if labels.get("model_name") == "echo":
            families.setdefault(line.split("{", 1)[0], set()).add(labels.get("model_version"))
    assert families["ts_inference_requests_total"] == {"1.0"} and len(families) >= 5, families
    assert {version for versions in families.values() for version in versions} == {"1.0"}, families
    assert 'model_version="default"' not in text

    def inference_lines() -> list[tuple[str, ...]]:  # management calls (DescribeModel) name no version
        return [line for line in access_lines(srv) if line[1] == "echo" and "Describe" not in line[0]]

    wait_for(lambda: len(inference_lines()) == 5, what="the access lines")
    assert {line[2] for line in inference_lines()} == {"1.0"}


def test_the_clients_request_id_is_in_torchserves_metric_lines(srv):
    request = inference_pb2.PredictionsRequest(model_name="metered", input={"data": b"abc"})
    assert srv.inference.Predictions(request, timeout=30, metadata=[("x-request-id", "trace-grpc-1")]).prediction \
        == b"abc"
    assert call(srv, "POST", "/predictions/metered", b"", {"x-request-id": "trace-http-2"})[0] == 200
    for rid in ("trace-grpc-1", "trace-http-2"):
        wait_for(lambda rid=rid: any(line[3] == rid for line in access_lines(srv)), what=f"the access line of {rid}")
        metric_lines = [line for line in srv.log().splitlines() if f"requestID:{rid}," in line]
        assert any("EchoRequests.Count:1|#ModelName:metered,Level:Model,kind:plain" in line for line in metric_lines)
        assert any("LastBatchSize.Count:1|" in line for line in metric_lines)


def test_v1_models_lists_the_models_the_openai_door_serves(srv):
    status, body = call(srv, "GET", "/v1/models")
    assert status == 200
    assert [card["id"] for card in json.loads(body)["data"]] == ["router", "router/1.0"]  # not echo, metered
    assert call(srv, "GET", "/v1/models/router/1.0")[0] == 200
    status, body = call(srv, "GET", "/v1/models/echo")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_form_body_at_a_json_door_is_a_400_that_says_so(srv, content_type):
    chat = json.dumps({"model": "router", "messages": [{"role": "user", "content": "hi"}]}).encode()
    fields = b"model=router&prompt=hi"
    body = fields if content_type.startswith("application/x-www") else chat
    status, answer = call(srv, "POST", "/v1/chat/completions", body, {"Content-Type": content_type})
    error = json.loads(answer)["error"]
    assert status == 400 and error["code"] == "form_body", answer
    assert "sent as a form" in error["message"] and "Content-Type: application/json" in error["message"]
    tensors = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}).encode()
    body = fields if content_type.startswith("application/x-www") else tensors
    status, answer = call(srv, "POST", "/v2/models/echo/infer", body, {"Content-Type": content_type})
    assert status == 400 and "sent as a form" in json.loads(answer)["error"], answer
    # the same body as JSON is served
    assert call(srv, "POST", "/v1/chat/completions", chat, {"Content-Type": "application/json"})[0] == 200
    # TorchServe's own API reads a form as form fields, as TorchServe does
    if content_type.startswith("application/x-www-form-urlencoded"):
        assert call(srv, "POST", "/predictions/echo", b"data=x", {"Content-Type": content_type}) == (200, b"x")


def test_json_text_sent_as_curl_d_sends_it_is_read_as_json(srv):
    """``curl -d @request.json`` (urlencoded Content-Type, JSON text), as KServe's samples send it."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    chat = json.dumps({"model": "router", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert call(srv, "POST", "/v1/chat/completions", chat, form)[0] == 200
    tensors = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}).encode()
    as_json = call(srv, "POST", "/v2/models/echo/infer", tensors, {"Content-Type": "application/json"})
    assert call(srv, "POST", "/v2/models/echo/infer", tensors, form) == as_json  # the same answer as JSON's
    status, answer = call(srv, "POST", "/v2/models/echo/infer", b"{not json", form)
    assert status == 400 and "sent as a form" not in json.loads(answer)["error"], answer
