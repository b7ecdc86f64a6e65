"""NVIDIA's tritonclient (the client KServe and Triton users have) against the real server, over
gRPC (``inference.GRPCInferenceService``) and HTTP (``/v2``), and the docs' tritonclient
example as written (its ports replaced by the test server's) with the docs' own handler.

tritonclient pins protobuf<7, so it runs from its own venv, ``.cache/venv-tritonclient``, made
once at test time (:mod:`tritonclient_venv`); each test runs a client script with that venv's
python as a subprocess and checks what it printed. Models: ``oip_doubler`` (a torch Linear
layer, y = 2x, FP32 [N, 2]) and ``oip_echo`` (echoes tensors, upper-cases BYTES).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator

import pytest
from open_inference_models import build_models
from tritonclient_venv import run_client

from conftest import ARCHIVER, ROOT, ServerProcess, read_key
from inference_service._proto import grpc_predict_v2_pb2

pytestmark = pytest.mark.external  # tritonclient, in a venv of its own

# Shared by both scripts: the calls, each one's outcome recorded as a value or as the error.
PRELUDE = r'''
import json, sys
import numpy as np
from tritonclient.utils import InferenceServerException

port, key = sys.argv[1], sys.argv[2]
HEADERS = {"authorization": "Bearer " + key}
out = {}

def record(name, call):
    try:
        out[name] = call()
    except InferenceServerException as exc:
        out[name] = {"status": str(exc.status()), "message": exc.message()}

def fp32(module, rows, shape=None):
    tensor = module.InferInput("INPUT0", [len(rows), 2], "FP32")
    tensor.set_data_from_numpy(np.array(rows, dtype=np.float32))
    if shape:
        tensor.set_shape(shape)  # after the data: a shape the data do not fill
    return [tensor]

def echo_inputs(module):
    text = module.InferInput("s", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"hello", "wörld".encode()], dtype=object))
    ints = module.InferInput("i", [3], "INT64")
    ints.set_data_from_numpy(np.array([1, -2, 2**40], dtype=np.int64))
    return [text, ints]
'''

GRPC = PRELUDE + r'''
import tritonclient.grpc as client
c = client.InferenceServerClient("127.0.0.1:" + port)
record("live", lambda: c.is_server_live(headers=HEADERS, client_timeout=30))
record("ready", lambda: c.is_server_ready(headers=HEADERS, client_timeout=30))
record("model_ready", lambda: c.is_model_ready("oip_doubler", headers=HEADERS, client_timeout=30))
record("unknown_ready", lambda: c.is_model_ready("nope", headers=HEADERS, client_timeout=30))
record("server_metadata", lambda: c.get_server_metadata(headers=HEADERS, as_json=True, client_timeout=30))
record("model_metadata", lambda: c.get_model_metadata("oip_doubler", headers=HEADERS, as_json=True,
                                                      client_timeout=30))

def doubled():
    result = c.infer("oip_doubler", fp32(client, [[1.0, 2.5], [-3.0, 0.25]]), headers=HEADERS, request_id="g1",
                     client_timeout=60)
    return {"id": result.get_response().id, "out": result.as_numpy("OUTPUT0").tolist(),
            "dtype": str(result.as_numpy("OUTPUT0").dtype)}
record("fp32", doubled)

def echoed():
    result = c.infer("oip_echo", echo_inputs(client), headers=HEADERS, client_timeout=60)
    return {"s": [v.decode() for v in result.as_numpy("s_upper").tolist()], "i": result.as_numpy("i_echo").tolist(),
            "i_dtype": str(result.as_numpy("i_echo").dtype)}
record("bytes_int64", echoed)
record("unknown_model", lambda: c.infer("nope", fp32(client, [[1.0, 2.0]]), headers=HEADERS, client_timeout=30))
record("wrong_shape", lambda: c.infer("oip_doubler", fp32(client, [[1.0, 2.0]], shape=[2, 2]), headers=HEADERS,
                                      client_timeout=30))
record("no_token", lambda: c.is_server_live(client_timeout=30))
record("wrong_token", lambda: c.infer("oip_doubler", fp32(client, [[1.0, 2.0]]),
                                      headers={"authorization": "Bearer wrong"}, client_timeout=30))
print(json.dumps(out))
'''

HTTP = PRELUDE + r'''
import tritonclient.http as client
c = client.InferenceServerClient("127.0.0.1:" + port, connection_timeout=30, network_timeout=60)
record("live", lambda: c.is_server_live(headers=HEADERS))
record("ready", lambda: c.is_server_ready(headers=HEADERS))
record("model_ready", lambda: c.is_model_ready("oip_doubler", headers=HEADERS))
record("unknown_ready", lambda: c.is_model_ready("nope", headers=HEADERS))
record("server_metadata", lambda: c.get_server_metadata(headers=HEADERS))
record("model_metadata", lambda: c.get_model_metadata("oip_doubler", headers=HEADERS))

def doubled(binary):
    inputs = fp32(client, [[1.0, 2.5], [-3.0, 0.25]])
    inputs[0].set_data_from_numpy(np.array([[1.0, 2.5], [-3.0, 0.25]], dtype=np.float32), binary_data=binary)
    outputs = [client.InferRequestedOutput("OUTPUT0", binary_data=binary)]
    result = c.infer("oip_doubler", inputs, outputs=outputs, headers=HEADERS, request_id="h1")
    return {"id": result.get_response().get("id"), "out": result.as_numpy("OUTPUT0").tolist(),
            "binary": "data" not in result.get_output("OUTPUT0")}
record("fp32_json", lambda: doubled(False))
record("fp32_binary", lambda: doubled(True))

def echoed():  # default options: binary tensor data both ways
    result = c.infer("oip_echo", echo_inputs(client), headers=HEADERS)
    return {"s": [v.decode() for v in result.as_numpy("s_upper").tolist()], "i": result.as_numpy("i_echo").tolist()}
record("bytes_int64", echoed)
record("unknown_model", lambda: c.infer("nope", fp32(client, [[1.0, 2.0]]), headers=HEADERS))
record("wrong_shape", lambda: c.infer("oip_doubler", fp32(client, [[1.0, 2.0]], shape=[2, 2]), headers=HEADERS))
record("no_token", lambda: c.get_server_metadata())
record("wrong_token", lambda: c.infer("oip_doubler", fp32(client, [[1.0, 2.0]]),
                                      headers={"authorization": "Bearer wrong"}))
print(json.dumps(out))
'''

# Every message this server declares must match tritonclient's own descriptor of Triton's
# grpc_service.proto (package "inference"): same field names, numbers, types and labels.
DESCRIPTORS = r'''
import json, sys
from google.protobuf import descriptor_pb2
from tritonclient.grpc import service_pb2

ours = descriptor_pb2.FileDescriptorProto.FromString(open(sys.argv[1], "rb").read())
theirs = descriptor_pb2.FileDescriptorProto()
service_pb2.DESCRIPTOR.CopyToProto(theirs)

def messages(prefix, items):
    out = {}
    for m in items:
        name = prefix + m.name
        out[name] = {f.name: (f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1]) for f in m.field}
        out.update(messages(name + ".", m.nested_type))
    return out

mine, triton = messages("", ours.message_type), messages("", theirs.message_type)
problems = []
for name, fields in mine.items():
    if name.endswith("Entry"):
        continue  # map entries
    for field, spec in fields.items():
        if triton.get(name, {}).get(field) != spec:
            problems.append([name, field, spec, triton.get(name, {}).get(field)])
service = {m.name: (m.input_type, m.output_type) for m in theirs.service[0].method}
rpcs = {m.name: (m.input_type, m.output_type) for m in ours.service[0].method}
problems += [[name, rpcs[name], service.get(name)] for name in rpcs if service.get(name) != rpcs[name]]
print(json.dumps({"package": theirs.package, "service": theirs.service[0].name, "checked": len(mine),
                  "problems": problems}))
'''


MODELS = ("oip_echo", "oip_doubler")


def readme_example() -> tuple[str, str]:
    """The docs' v2 handler (its ``cat > v2_double.py`` heredoc) and its tritonclient example."""
    section = (ROOT / "docs" / "open-inference-protocol.md").read_text()
    handler = re.search(r"cat > v2_double.py <<'EOF'\n(.*?)^EOF$", section, re.S | re.M)
    example = re.search(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert handler and example, "the docs' Open Inference Protocol example moved"
    return handler[1], example[1]


@pytest.fixture(scope="module")
def triton_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server (token authorization on, one worker per model) with oip_echo, oip_doubler and the
    docs' v2double loaded."""
    store = tmp_path_factory.mktemp("triton_store")
    handler = tmp_path_factory.mktemp("readme") / "v2_double.py"
    handler.write_text(readme_example()[0])
    subprocess.run([ARCHIVER, "--model-name", "v2double", "--version", "1.0", "--handler", str(handler),
                    "--export-path", str(store)], check=True, capture_output=True, timeout=60)
    srv = ServerProcess(tmp_path_factory.mktemp("triton_server"), store,
                        ["--workers-per-model", "1", "--models", *build_models(store, MODELS), "v2double=v2double.mar"])
    try:
        for name in (*MODELS, "v2double"):
            srv.wait_workers(name, 1, timeout=120)
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log()


def run(script: str, port: int, srv: ServerProcess) -> dict:
    """Run a client script against ``port`` with the inference key; returns the JSON it printed last."""
    proc = run_client(script, str(port), read_key(srv.key_file, "inference"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tritonclient_grpc(triton_server):
    out = run(GRPC, triton_server.inference_port, triton_server)
    assert (out["live"], out["ready"], out["model_ready"]) == (True, True, True)
    assert out["unknown_ready"]["status"] == "StatusCode.NOT_FOUND"
    assert out["server_metadata"]["name"] == "inference-service"
    assert out["model_metadata"] == {"name": "oip_doubler", "versions": ["1.0"]}
    assert out["fp32"] == {"id": "g1", "out": [[2.0, 5.0], [-6.0, 0.5]], "dtype": "float32"}
    assert out["bytes_int64"] == {"s": ["HELLO", "WÖRLD"], "i": [1, -2, 2**40], "i_dtype": "int64"}
    assert out["unknown_model"]["status"] == "StatusCode.NOT_FOUND"
    assert out["wrong_shape"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "8 raw bytes do not hold 4 FP32 elements" in out["wrong_shape"]["message"]
    assert out["no_token"]["status"] == out["wrong_token"]["status"] == "StatusCode.UNAUTHENTICATED"


def test_tritonclient_http(triton_server):
    out = run(HTTP, triton_server.status["http_port"], triton_server)
    assert (out["live"], out["ready"], out["model_ready"], out["unknown_ready"]) == (True, True, True, False)
    assert out["server_metadata"]["extensions"] == ["binary_tensor_data"]
    assert out["model_metadata"]["versions"] == ["1.0"]
    assert out["fp32_json"] == {"id": "h1", "out": [[2.0, 5.0], [-6.0, 0.5]], "binary": False}
    assert out["fp32_binary"] == {"id": "h1", "out": [[2.0, 5.0], [-6.0, 0.5]], "binary": True}
    assert out["bytes_int64"] == {"s": ["HELLO", "WÖRLD"], "i": [1, -2, 2**40]}
    assert out["unknown_model"] == {"status": "404", "message": "model 'nope' is not registered"}
    assert out["wrong_shape"]["status"] == "400" and "do not hold 4 FP32 elements" in out["wrong_shape"]["message"]
    assert out["no_token"]["status"] == out["wrong_token"]["status"] == "401"


def test_messages_match_tritons_proto(tmp_path):
    ours = tmp_path / "grpc_predict_v2.binpb"
    ours.write_bytes(grpc_predict_v2_pb2.DESCRIPTOR.serialized_pb)
    proc = run_client(DESCRIPTORS, str(ours))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert (result["package"], result["service"]) == ("inference", "GRPCInferenceService")
    assert result["checked"] >= 20 and result["problems"] == []


def test_readme_tritonclient_example(triton_server):
    example = readme_example()[1]
    example = example.replace("127.0.0.1:7070", f"127.0.0.1:{triton_server.inference_port}")
    example = example.replace("127.0.0.1:8080", f"127.0.0.1:{triton_server.status['http_port']}")
    proc = run_client(example, cwd=triton_server.workdir)  # key_file.json is in the server's directory
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["True True", "[[2. 4.]", " [6. 8.]]", "[[2. 4.]", " [6. 8.]]"]
