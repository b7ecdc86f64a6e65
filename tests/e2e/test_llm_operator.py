"""What an operator and a plain client see of an LLM stream: the HTTP stream forms (raw, usage on
its own line, NDJSON), the bundled gRPC client's output, one request id from the access line to
the worker's line, and the refusal of an Open Inference Protocol body.

One real server with a tiny random-weight Llama (SmolLM2's tokenizer), as the bundled LLM
archive serves it (continuous batching).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from conftest import ROOT, ServerProcess, read_key, wait_for
from inference_service._proto import inference_pb2

BODY = {"prompt": "Count: one, two, three,", "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory, tiny_llama, llm_archives):
    store = tmp_path_factory.mktemp("op_store")
    llm_archives.build(store, "--model-path", str(tiny_llama), "--name", "tiny")
    srv = ServerProcess(tmp_path_factory.mktemp("op_work"), store, ["--models", "tiny=tiny.mar"])
    try:
        srv.wait_workers("tiny", 1, timeout=300)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _post(srv: ServerProcess, path: str, body: dict, headers: dict[str, str] | None = None,
          ) -> tuple[http.client.HTTPResponse, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.status["http_port"], timeout=120)
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}",
                      "Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response, response.read()
    finally:
        conn.close()


def _grpc_text(srv: ServerProcess, body: dict) -> str:
    return b"".join(srv.stream("tiny", json.dumps(body), timeout=120)).decode()


def test_default_stream_is_raw_text(tiny_server):
    response, data = _post(tiny_server, "/predictions/tiny", BODY)
    assert response.status == 200 and response.getheader("Transfer-Encoding") == "chunked"
    assert response.getheader("Content-Type") == "text/plain; charset=utf-8"
    assert data.decode() == _grpc_text(tiny_server, BODY)  # TorchServe's raw text, nothing added


def test_usage_stands_on_its_own_last_line(tiny_server):
    response, data = _post(tiny_server, "/predictions/tiny", {**BODY, "include_usage": True})
    assert response.status == 200
    text = data.decode()
    assert text.endswith("\n")
    answer, _, last = text[:-1].rpartition("\n")
    usage = json.loads(last)
    assert usage["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == 12
    assert usage["text"] == "" and answer == _grpc_text(tiny_server, BODY)


def test_ndjson_is_one_object_per_line(tiny_server):
    response, data = _post(tiny_server, "/predictions/tiny", {**BODY, "include_usage": True},
                           {"Accept": "application/x-ndjson"})
    assert response.status == 200 and response.getheader("Content-Type") == "application/x-ndjson"
    assert data.endswith(b"\n")
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert len(lines) > 2 and all(set(line) == {"text"} for line in lines[:-1])
    assert "".join(line["text"] for line in lines) == _grpc_text(tiny_server, BODY)
    assert lines[-1]["usage"]["completion_tokens"] == 12
    # without include_usage: text pieces only
    _, data = _post(tiny_server, "/predictions/tiny", BODY, {"Accept": "application/x-ndjson"})
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert all(set(line) == {"text"} for line in lines) and "".join(x["text"] for x in lines) == _grpc_text(
        tiny_server, BODY)


def test_grpc_client_ends_the_answer_line_before_the_usage(tiny_server, tmp_path: Path):
    (tmp_path / "body.json").write_text(json.dumps({**BODY, "include_usage": True}))
    proc = subprocess.run([sys.executable, str(ROOT / "clients" / "torchserve_grpc_client.py"),
                           "--inference-port", str(tiny_server.inference_port), "--key-file",
                           str(tiny_server.key_file), "infer_stream", "tiny", str(tmp_path / "body.json")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout
    answer, usage = proc.stdout.rstrip("\n").rsplit("\n", 1)
    assert answer == _grpc_text(tiny_server, BODY)
    assert usage.startswith("finish_reason: length, ") and "completion_tokens: 12" in usage


def _log_lines(srv: ServerProcess, fragment: str) -> list[str]:
    """The log lines holding ``fragment``, waited for (the worker's lines arrive through a pipe)."""
    return wait_for(lambda: [line for line in srv.log().splitlines() if fragment in line], timeout=30)


def test_one_request_id_from_access_line_to_worker_line(tiny_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    response, _ = _post(tiny_server, "/v1/chat/completions", body, {"x-request-id": "abc-123"})
    assert response.status == 200 and response.getheader("X-Request-Id") == "abc-123"
    access = _log_lines(tiny_server, "POST /v1/chat/completions model=tiny ")
    assert any("request_id=abc-123" in line for line in access), access
    assert _log_lines(tiny_server, "request abc-123: ")  # the worker's per-request line
    # gRPC: the metadata's id, echoed as trailing metadata
    responses = tiny_server.inference.StreamPredictions(
        inference_pb2.PredictionsRequest(model_name="tiny", input={"data": json.dumps(BODY).encode()}),
        metadata=(("x-request-id", "grpc-42"),), timeout=120)
    list(responses)
    assert ("x-request-id", "grpc-42") in tuple(responses.trailing_metadata())
    assert _log_lines(tiny_server, "StreamPredictions model=tiny ") and _log_lines(tiny_server, "request grpc-42: ")
    assert any("request_id=grpc-42" in x for x in _log_lines(tiny_server, "StreamPredictions model=tiny "))


def test_request_id_is_made_when_absent_or_invalid(tiny_server):
    made = []
    for headers in ({}, {"x-request-id": "bad id\twith spaces"}):
        response, _ = _post(tiny_server, "/predictions/tiny", BODY, headers)
        rid = response.getheader("X-Request-Id")
        assert rid and len(rid) == 32 and rid not in made
        made.append(rid)
        assert _log_lines(tiny_server, f"request_id={rid}") and _log_lines(tiny_server, f"request {rid}: ")


def test_v2_body_is_served_on_v2_and_refused_elsewhere_with_the_way_to_go(tiny_server):
    v2 = {"id": "1", "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["Hello"]}],
          "parameters": {"max_tokens": 4, "ignore_eos": True}}
    response, data = _post(tiny_server, "/v2/models/tiny/infer", v2)  # the /v2 door translates it (issue 49)
    assert response.status == 200, data
    (output,) = json.loads(data)["outputs"]
    assert output["name"] == "text_output" and output["data"][0], output
    with pytest.raises(grpc.RpcError) as info:
        tiny_server.predict("tiny", json.dumps({"id": "1", "model_name": "tiny", "inputs": []}), timeout=60)
    message = info.value.details()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not an Open Inference Protocol (v2) body" in message
    assert "/v2/models/<model>/infer" in message and "/v1/completions" in message
