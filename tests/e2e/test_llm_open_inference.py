"""The bundled LLM over the Open Inference Protocol (issue 49 item 4), as KServe's TorchServe runtime
configures the server (``service_envelope=kservev2``): a BYTES prompt on ``/v2/models/<m>/infer``
(HTTP and gRPC ``ModelInfer``) answers the generated text as the BYTES output ``text_output``;
Triton's generate extension (``/generate``, ``/generate_stream``) answers ``text_output``. It
answered 200 with ``"data": [""]`` before."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from conftest import ServerProcess, read_key
from inference_service._proto import grpc_predict_v2_pb2 as v2_pb2
from inference_service._proto import grpc_predict_v2_pb2_grpc as v2_grpc

pytestmark = [pytest.mark.llm, pytest.mark.slow]

QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, llm_archives) -> Iterator[ServerProcess]:
    own = tmp_path_factory.mktemp("oip_llm_store")
    llm_archives.build(own)  # smollm2.mar, the bundled archive (OpenVINO)
    work = tmp_path_factory.mktemp("oip_llm")
    config = work / "config.properties"
    config.write_text("service_envelope=kservev2\n")
    srv = ServerProcess(work, own, ["--ts-config", str(config), "--models", "smollm2=smollm2.mar"])
    try:
        srv.wait_workers("smollm2", 1, timeout=600)
        assert "the kservev2 envelope is not applied to the LLM handler" in srv.log()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _post(srv: ServerProcess, path: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{srv.status['http_port']}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {read_key(srv.key_file, 'inference')}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _bytes_request(text: str, **parameters: object) -> dict:
    body: dict = {"inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES", "data": [text]}]}
    if parameters:
        body["parameters"] = parameters
    return body


def test_a_bytes_prompt_generates_its_answer_over_http_and_grpc(server):
    status, body = _post(server, "/v2/models/smollm2/infer", _bytes_request(QUESTION))
    assert status == 200, body
    answer = json.loads(body)
    (output,) = answer["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("text_output", "BYTES", [1])
    assert "Paris" in output["data"][0], output
    assert answer["model_name"] == "smollm2" and answer["model_version"]
    chat = json.dumps({"messages": [{"role": "user", "content": QUESTION}], "max_new_tokens": 24})
    status, body = _post(server, "/v2/models/smollm2/infer", _bytes_request(chat))  # an LLM request as JSON
    assert status == 200 and "Paris" in json.loads(body)["outputs"][0]["data"][0], body
    stub = v2_grpc.GRPCInferenceServiceStub(server.channel)
    request = v2_pb2.ModelInferRequest(model_name="smollm2", inputs=[v2_pb2.ModelInferRequest.InferInputTensor(
        name="input-0", datatype="BYTES", shape=[1], contents=v2_pb2.InferTensorContents(bytes_contents=[
            PROMPT.encode()]))])
    request.parameters["max_tokens"].int64_param = 8
    request.parameters["temperature"].int64_param = 0
    response = stub.ModelInfer(request, timeout=300)
    assert response.outputs[0].name == "text_output"
    text = (response.raw_output_contents[0][4:] if response.raw_output_contents
            else response.outputs[0].contents.bytes_contents[0]).decode()
    status, body = _post(server, "/v2/models/smollm2/infer", _bytes_request(PROMPT, max_tokens=8, temperature=0))
    assert status == 200 and json.loads(body)["outputs"][0]["data"][0] == text, (body, text)  # as over HTTP


def test_tritons_generate_extension(server):
    status, body = _post(server, "/v2/models/smollm2/generate",
                         {"text_input": PROMPT, "parameters": {"max_tokens": 12, "temperature": 0}})
    assert status == 200, body
    whole = json.loads(body)
    assert set(whole) == {"model_name", "model_version", "text_output"} and whole["model_name"] == "smollm2"
    assert "Paris" in whole["text_output"], whole
    status, body = _post(server, "/v2/models/smollm2/generate_stream",
                         {"text_input": PROMPT, "parameters": {"max_tokens": 12, "temperature": 0, "stream": True}})
    assert status == 200, body
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert len(events) > 2 and "".join(e["text_output"] for e in events) == whole["text_output"], events


def test_what_an_llm_cannot_read_is_a_400_naming_it(server):
    cases = [
        ("/v2/models/smollm2/generate", {"prompt": PROMPT}, "text_input"),
        ("/v2/models/smollm2/generate", {"text_input": PROMPT, "parameters": {"beam_width": 2}}, "'beam_width'"),
        ("/v2/models/smollm2/infer", {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}]},
         "send one BYTES element"),
        ("/v2/models/smollm2/infer", {"inputs": [{"name": "a", "shape": [1], "datatype": "BYTES", "data": ["x"]},
                                                 {"name": "b", "shape": [1], "datatype": "BYTES", "data": ["y"]}]},
         "got 2 inputs"),
    ]
    for path, body, needle in cases:
        status, answer = _post(server, path, body)
        assert status == 400 and needle in json.loads(answer)["error"], (path, status, answer)
    status, body = _post(server, "/v2/models/smollm2/generate", {"text_input": PROMPT,
                                                                 "parameters": {"max_tokens": 2}})
    assert status == 200 and json.loads(body)["text_output"]  # the worker serves on
