"""The Open Inference Protocol (KServe v2) against a real server and real workers, with this
project's own stubs: gRPC under TorchServe's package (``org.pytorch.serve.grpc.openinference``)
and KServe's (``inference``), and the ``/v2`` HTTP routes. tritonclient itself drives the server
in ``test_tritonclient.py``.

Models: ``oip_echo`` (a module-level handle that echoes tensors, upper-cases base64 BYTES and can
show the JSON body it got), ``oip_doubler`` (a BaseHandler running a torch Linear layer, y = 2x, on
FP32 [N, 2]) and ``oip_kservev2`` (the same model behind TorchServe's ``kservev2`` envelope).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status
from open_inference_models import build_models
from torchserve_wheel import extract_torchserve_protos

from conftest import ServerProcess, auth_metadata, build_mar, doubler_weights, read_key
from inference_service._proto import grpc_predict_v2_pb2 as kserve_pb2
from inference_service._proto import grpc_predict_v2_pb2_grpc as kserve_grpc
from inference_service._proto import open_inference_grpc_pb2 as ts_pb2
from inference_service._proto import open_inference_grpc_pb2_grpc as ts_grpc

ROOT = Path(__file__).resolve().parents[2]
BUF = Path(sys.executable).parent / "buf"
PACKAGES = pytest.mark.parametrize("pb2", [ts_pb2, kserve_pb2], ids=["torchserve", "kserve"])


MODELS = ("oip_echo", "oip_doubler", "oip_kservev2")


@pytest.fixture(scope="module")
def oip(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server (model API on, one worker per model) with the three v2 models loaded at startup."""
    store = tmp_path_factory.mktemp("oip_store")
    srv = ServerProcess(tmp_path_factory.mktemp("oip_server"), store,
                        ["--enable-model-api", "--workers-per-model", "1", "--models", *build_models(store, MODELS)])
    try:
        for name in MODELS:
            srv.wait_workers(name, 1, timeout=120)
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log()


def stub(srv: ServerProcess, pb2: Any) -> Any:
    """A GRPCInferenceService stub of ``pb2``'s package on the server's (key-sending) channel."""
    return (ts_grpc if pb2 is ts_pb2 else kserve_grpc).GRPCInferenceServiceStub(srv.channel)


def rpc_error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The error ``call`` fails with (asserting that it fails)."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=30, **kwargs)
    return info.value


def http(srv: ServerProcess, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None, key: str | None = "inference") -> tuple[int, Any, bytes]:
    """One HTTP call to the server's HTTP API: ``(status, headers, body)``; a body is sent as JSON
    unless ``headers`` say otherwise (urllib would label it a form)."""
    all_headers = {"Content-Type": "application/json"} if body is not None else {}
    all_headers.update(headers or {})
    if key:
        all_headers["Authorization"] = f"Bearer {read_key(srv.key_file, key)}"
    request = urllib.request.Request(f"http://127.0.0.1:{srv.status['http_port']}{path}", data=body,
                                     method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def fp32_request(pb2: Any, model: str, rows: list[list[float]], raw: bool = False, **fields: Any) -> Any:
    """A ModelInferRequest with the FP32 input ``INPUT0`` holding ``rows`` (typed, or raw)."""
    request = pb2.ModelInferRequest(model_name=model, **fields)
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[len(rows), len(rows[0])])
    values = [v for row in rows for v in row]
    if raw:
        request.raw_input_contents.append(struct.pack(f"<{len(values)}f", *values))
    else:
        tensor.contents.fp32_contents.extend(values)
    return request


# --------------------------------------------------------------------------- health and metadata
@PACKAGES
def test_health(oip, pb2):
    api = stub(oip, pb2)
    assert api.ServerLive(pb2.ServerLiveRequest(), timeout=30).live
    assert api.ServerReady(pb2.ServerReadyRequest(), timeout=30).ready
    assert api.ModelReady(pb2.ModelReadyRequest(name="oip_echo"), timeout=30).ready
    assert api.ModelReady(pb2.ModelReadyRequest(name="oip_doubler", version="1.0"), timeout=30).ready
    err = rpc_error(api.ModelReady, pb2.ModelReadyRequest(name="nope"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.details()
    assert rpc_error(api.ModelReady, pb2.ModelReadyRequest(name="oip_echo", version="9")).code() == \
        grpc.StatusCode.NOT_FOUND
    assert rpc_error(api.ModelReady, pb2.ModelReadyRequest()).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_without_workers_is_not_ready(oip):
    oip.register("oip_echo.mar", model_name="oip_cold", initial_workers=0)
    try:
        api = stub(oip, kserve_pb2)
        assert not api.ModelReady(kserve_pb2.ModelReadyRequest(name="oip_cold"), timeout=30).ready
        status, _, body = http(oip, "GET", "/v2/models/oip_cold/ready")
        assert (status, json.loads(body)) == (400, {"name": "oip_cold", "ready": False})
    finally:
        oip.unregister("oip_cold")


@PACKAGES
def test_metadata(oip, pb2):
    api = stub(oip, pb2)
    server = api.ServerMetadata(pb2.ServerMetadataRequest(), timeout=30)
    assert server.name == "inference-service" and server.version and list(server.extensions) == ["binary_tensor_data"]
    model = api.ModelMetadata(pb2.ModelMetadataRequest(name="oip_doubler"), timeout=30)
    assert (model.name, list(model.versions), model.platform, list(model.inputs)) == ("oip_doubler", ["1.0"], "", [])
    assert rpc_error(api.ModelMetadata, pb2.ModelMetadataRequest(name="nope")).code() == grpc.StatusCode.NOT_FOUND


# --------------------------------------------------------------------------- ModelInfer
@PACKAGES
@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_fp32_through_a_torch_model(oip, pb2, raw):
    request = fp32_request(pb2, "oip_doubler", [[1.0, 2.5], [-3.0, 0.25]], raw=raw, id="req-1")
    response = stub(oip, pb2).ModelInfer(request, timeout=60)
    assert (response.model_name, response.model_version, response.id) == ("oip_doubler", "1.0", "req-1")
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("OUTPUT0", "FP32", [2, 2])
    if raw:  # answered as asked: raw in, raw out (what tritonclient reads)
        assert not output.HasField("contents")
        assert list(struct.unpack("<4f", response.raw_output_contents[0])) == [2.0, 5.0, -6.0, 0.5]
    else:  # typed in, typed out (TorchServe's form)
        assert not response.raw_output_contents
        assert list(output.contents.fp32_contents) == [2.0, 5.0, -6.0, 0.5]


@PACKAGES
def test_handler_gets_torchserves_json_body(oip, pb2):
    request = pb2.ModelInferRequest(model_name="oip_echo", id="abc")
    request.inputs.add(name="x", datatype="INT64", shape=[1, 2]).contents.int64_contents.extend([7, -8])
    request.inputs.add(name="s", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hi\x00")
    request.parameters["show_request"].bool_param = True
    response = stub(oip, pb2).ModelInfer(request, timeout=30)
    shown = json.loads(response.outputs[-1].contents.bytes_contents[0])
    assert shown == {"id": "abc", "model_name": "oip_echo", "parameters": {"show_request": True}, "inputs": [
        {"name": "x", "shape": [1, 2], "datatype": "INT64", "data": [7, -8]},
        {"name": "s", "shape": [1], "datatype": "BYTES", "data": ["aGkA"]}]}  # BYTES base64, as TorchServe


@PACKAGES
def test_bytes_and_int64(oip, pb2):
    typed = pb2.ModelInferRequest(model_name="oip_echo")
    typed.inputs.add(name="s", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"hello", "wörld".encode()])
    typed.inputs.add(name="i", datatype="INT64", shape=[2]).contents.int64_contents.extend([2**62, -1])
    response = stub(oip, pb2).ModelInfer(typed, timeout=30)
    assert [o.name for o in response.outputs] == ["s_upper", "i_echo"]
    assert list(response.outputs[0].contents.bytes_contents) == [b"HELLO", "WÖRLD".encode()]
    assert list(response.outputs[1].contents.int64_contents) == [2**62, -1]

    raw = pb2.ModelInferRequest(model_name="oip_echo")
    raw.inputs.add(name="s", datatype="BYTES", shape=[2])
    raw.inputs.add(name="i", datatype="INT64", shape=[2])
    raw.raw_input_contents.extend([b"\x01\x00\x00\x00a\x02\x00\x00\x00bc", struct.pack("<2q", 5, -(2**63))])
    raw.outputs.add(name="i_echo")  # only this one
    response = stub(oip, pb2).ModelInfer(raw, timeout=30)
    assert [o.name for o in response.outputs] == ["i_echo"]
    assert struct.unpack("<2q", response.raw_output_contents[0]) == (5, -(2**63))


def test_large_tensor_round_trip(oip):
    """100,000 elements (converted in a worker thread, off the event loop) both ways, gRPC and HTTP."""
    n = 100_000
    values = [float(i) / 8 for i in range(n)]
    request = kserve_pb2.ModelInferRequest(model_name="oip_echo")
    request.inputs.add(name="x", datatype="FP32", shape=[n])
    request.raw_input_contents.append(struct.pack(f"<{n}f", *values))
    response = stub(oip, kserve_pb2).ModelInfer(request, timeout=120)
    assert list(struct.unpack(f"<{n}f", response.raw_output_contents[0])) == values
    head = json.dumps({"inputs": [{"name": "x", "datatype": "INT32", "shape": [n],
                                   "parameters": {"binary_data_size": 4 * n}}],
                       "parameters": {"binary_data_output": True}}).encode()
    status, headers, answer = http(oip, "POST", "/v2/models/oip_echo/infer",
                                   head + struct.pack(f"<{n}i", *range(-n, 0)),
                                   {"Inference-Header-Content-Length": str(len(head))})
    assert status == 200, answer[:300]
    assert struct.unpack(f"<{n}i", answer[int(headers["Inference-Header-Content-Length"]):]) == tuple(range(-n, 0))


def test_fp16_output_goes_raw(oip):
    request = kserve_pb2.ModelInferRequest(model_name="oip_echo")
    request.inputs.add(name="b", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    request.parameters["answer"].string_param = "fp16"
    response = stub(oip, kserve_pb2).ModelInfer(request, timeout=30)
    assert [o.name for o in response.outputs] == ["b_echo", "half"]
    assert response.raw_output_contents[0] == b"\x01"
    assert struct.unpack("<2e", response.raw_output_contents[1]) == (0.5, 1.5)


def test_kservev2_envelope_handler(oip):
    request = fp32_request(ts_pb2, "oip_kservev2", [[1.0, 2.0]], id="env")
    response = stub(oip, ts_pb2).ModelInfer(request, timeout=60)
    (output,) = response.outputs  # named after the input, as TorchServe's envelope names it
    assert (response.id, response.model_version, output.name, output.datatype, list(output.shape)) == \
        ("env", "1.0", "INPUT0", "FP32", [1, 2])
    assert list(output.contents.fp32_contents) == [2.0, 4.0]
    body = json.dumps({"id": "h", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2],
                                              "data": [1, 2, 3, 4]}]}).encode()
    status, _, answer = http(oip, "POST", "/v2/models/oip_kservev2/infer", body)
    assert status == 200, answer
    assert json.loads(answer) == {"model_name": "oip_kservev2", "model_version": "1.0", "id": "h", "outputs": [
        {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [2.0, 4.0, 6.0, 8.0]}]}


def test_service_envelope_wraps_an_unmodified_torchserve_handler(tmp_path):
    """``service_envelope=kservev2`` in config.properties wraps every model's handler in the
    envelope, as TorchServe does, so a handler written for it runs unchanged."""
    store = tmp_path / "store"
    store.mkdir()
    weights = doubler_weights(store / "doubler.pt")
    build_mar(store, "env_doubler", "kservev2_doubler_handler.py", serialized=str(weights),
              model_file="doubler_model.py")
    config = tmp_path / "config.properties"
    config.write_text("service_envelope=kservev2\n")
    srv = ServerProcess(tmp_path / "work", store, ["--ts-config", str(config), "--workers-per-model", "1",
                                                   "--models", "env_doubler=env_doubler.mar"])
    try:
        srv.wait_workers("env_doubler", 1, timeout=120)
        response = stub(srv, kserve_pb2).ModelInfer(
            fp32_request(kserve_pb2, "env_doubler", [[1.0, 2.0], [3.0, 4.0]], id="e"), timeout=60)
        (output,) = response.outputs
        assert (response.id, output.name, list(output.shape)) == ("e", "INPUT0", [2, 2])
        assert list(output.contents.fp32_contents) == [2.0, 4.0, 6.0, 8.0]
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [5, 6]}]})
        status, _, answer = http(srv, "POST", "/v2/models/env_doubler/infer", body.encode())
        assert status == 200, answer
        assert json.loads(answer)["outputs"] == [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                                  "data": [10.0, 12.0]}]
    finally:
        assert srv.stop() == 0, srv.log()


def test_unknown_service_envelope_is_refused_at_start(tmp_path):
    config = tmp_path / "config.properties"
    config.write_text("service_envelope=soap\n")
    proc = subprocess.run([sys.executable, "-m", "inference_service", "--foreground", "--ncs", "--ts-config",
                           str(config)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and "service_envelope" in proc.stderr + proc.stdout


# --------------------------------------------------------------------------- errors
@PACKAGES
def test_errors(oip, pb2):
    api = stub(oip, pb2)
    err = rpc_error(api.ModelInfer, fp32_request(pb2, "nope", [[1.0, 2.0]]))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'nope' is not registered" in err.details()
    info = rpc_status.from_call(err)
    assert info is not None and info.details  # the rich ErrorInfo of every failing RPC

    wrong = fp32_request(pb2, "oip_doubler", [[1.0, 2.0]])
    wrong.inputs[0].shape[:] = [2, 2]
    err = rpc_error(api.ModelInfer, wrong)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shape [2, 2] holds 4 elements, got 2" in err.details()
    wrong_raw = fp32_request(pb2, "oip_doubler", [[1.0, 2.0]], raw=True)
    wrong_raw.inputs[0].shape[:] = [1, 3]
    err = rpc_error(api.ModelInfer, wrong_raw)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "8 raw bytes do not hold 3 FP32" in err.details()
    unknown_type = pb2.ModelInferRequest(model_name="oip_echo")
    unknown_type.inputs.add(name="x", datatype="FP8", shape=[1])
    assert rpc_error(api.ModelInfer, unknown_type).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc_error(api.ModelInfer, fp32_request(pb2, "", [[1.0]])).code() == grpc.StatusCode.INVALID_ARGUMENT

    missing_output = fp32_request(pb2, "oip_echo", [[1.0]])
    missing_output.outputs.add(name="nothing")
    err = rpc_error(api.ModelInfer, missing_output)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "['nothing'] are not produced" in err.details()

    not_v2 = fp32_request(pb2, "oip_echo", [[1.0]])
    not_v2.parameters["answer"].string_param = "not_v2"
    err = rpc_error(api.ModelInfer, not_v2)
    assert err.code() == grpc.StatusCode.INTERNAL and "not a v2 inference response" in err.details()
    bad_shape = fp32_request(pb2, "oip_echo", [[1.0]])
    bad_shape.parameters["answer"].string_param = "bad_shape"
    err = rpc_error(api.ModelInfer, bad_shape)
    assert err.code() == grpc.StatusCode.INTERNAL and "output 'bad': shape [3] holds 3 elements" in err.details()
    fails = fp32_request(pb2, "oip_echo", [[1.0]])
    fails.parameters["fail"].bool_param = True
    err = rpc_error(api.ModelInfer, fails)
    assert err.code() == grpc.StatusCode.INTERNAL and "failed on purpose" in err.details()
    # the worker is still serving
    assert api.ModelInfer(fp32_request(pb2, "oip_echo", [[3.0]]), timeout=30).outputs[0].contents.fp32_contents[0] == 3


@PACKAGES
def test_token_authorization(oip, pb2):
    bare = grpc.insecure_channel(f"127.0.0.1:{oip.inference_port}")
    try:
        api = (ts_grpc if pb2 is ts_pb2 else kserve_grpc).GRPCInferenceServiceStub(bare)
        for call, request in ((api.ServerLive, pb2.ServerLiveRequest()),
                              (api.ModelInfer, fp32_request(pb2, "oip_echo", [[1.0]]))):
            assert rpc_error(call, request).code() == grpc.StatusCode.UNAUTHENTICATED
            err = rpc_error(call, request, metadata=(("authorization", "Bearer wrong"),))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert api.ServerLive(pb2.ServerLiveRequest(), timeout=30,
                              metadata=auth_metadata(oip.key_file, "inference")).live
        err = rpc_error(api.ServerLive, pb2.ServerLiveRequest(), metadata=auth_metadata(oip.key_file, "management"))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # the inference key, not the management one
    finally:
        bare.close()


# --------------------------------------------------------------------------- HTTP
def test_http_health_and_metadata(oip):
    assert http(oip, "GET", "/v2/health/live")[::2] == (200, b'{"live": true}')
    assert http(oip, "GET", "/v2/health/ready")[::2] == (200, b'{"ready": true}')
    status, _, body = http(oip, "GET", "/v2/models/oip_echo/versions/1.0/ready")
    assert (status, json.loads(body)) == (200, {"name": "oip_echo", "ready": True})
    status, _, body = http(oip, "GET", "/v2")
    assert status == 200 and json.loads(body)["name"] == "inference-service"
    status, _, body = http(oip, "GET", "/v2/models/oip_doubler")
    assert (status, json.loads(body)) == (200, {"name": "oip_doubler", "versions": ["1.0"], "platform": "",
                                                "inputs": [], "outputs": []})
    for path in ("/v2/models/nope", "/v2/models/nope/ready", "/v2/models/oip_echo/versions/9/ready"):
        status, _, body = http(oip, "GET", path)
        assert status == 404 and set(json.loads(body)) == {"error"}, (path, body)
    status, _, body = http(oip, "GET", "/v2/nothing/here")  # no such route: the HTTP API's own 404
    assert status == 404 and json.loads(body)["type"] == "ResourceNotFoundException"


def test_http_infer_json_and_binary(oip):
    body = json.dumps({"id": "j", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2],
                                              "data": [[1.5, -1]]}]}).encode()
    status, headers, answer = http(oip, "POST", "/v2/models/oip_doubler/infer", body,
                                   {"Content-Type": "application/json"})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(answer) == {"model_name": "oip_doubler", "model_version": "1.0", "id": "j", "outputs": [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 2], "data": [3.0, -2.0]}]}

    # Triton's binary tensor data extension, both ways (what tritonclient sends by default)
    head = json.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1],
                                   "parameters": {"binary_data_size": 7}}],
                       "parameters": {"binary_data_output": True}}).encode()
    status, headers, answer = http(oip, "POST", "/v2/models/oip_echo/versions/1.0/infer",
                                   head + b"\x03\x00\x00\x00abc", {"Inference-Header-Content-Length": str(len(head))})
    assert status == 200, answer
    length = int(headers["Inference-Header-Content-Length"])
    assert json.loads(answer[:length])["outputs"] == [
        {"name": "s_upper", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 7}}]
    assert answer[length:] == b"\x03\x00\x00\x00ABC"


def test_http_errors(oip):
    good = json.dumps({"inputs": [{"name": "x", "datatype": "INT64", "shape": [2], "data": [1, 2]}]}).encode()
    cases = [
        ("/v2/models/nope/infer", good, {}, "inference", 404, "'nope' is not registered"),
        ("/v2/models/oip_echo/infer", good.replace(b"[2]", b"[3]"), {}, "inference", 400, "holds 3 elements, got 2"),
        ("/v2/models/oip_echo/infer", b"{", {}, "inference", 400, "not JSON"),
        ("/v2/models/oip_echo/infer", good, {}, None, 401, "Token Authorization failed"),
        ("/v2/models/oip_echo/infer", good, {}, "management", 401, "Token Authorization failed"),
        ("/v2/models/oip_echo/infer", good.replace(b'"inputs"', b'"parameters": {"fail": true}, "inputs"'), {},
         "inference", 503, "failed on purpose"),  # a handler that raised: TorchServe's 503
    ]
    for path, body, headers, key, want_status, needle in cases:
        status, response_headers, answer = http(oip, "POST", path, body, headers, key)
        assert status == want_status and needle in json.loads(answer)["error"], (path, status, answer)
        assert set(json.loads(answer)) == {"error"}
        if status == 401:
            assert response_headers["WWW-Authenticate"] == "Bearer"
    status, headers, _ = http(oip, "GET", "/v2/models/oip_echo/infer")
    assert status == 405 and "POST" in headers["Allow"]


# --------------------------------------------------------------------------- reflection and the wire
def test_reflection_lists_both_packages(oip):
    db = ProtoReflectionDescriptorDatabase(oip.channel)
    services = set(db.get_services())
    assert {"inference.GRPCInferenceService", "org.pytorch.serve.grpc.openinference.GRPCInferenceService"} <= services
    method = DescriptorPool(db).FindServiceByName("inference.GRPCInferenceService").FindMethodByName("ModelInfer")
    assert method.input_type.fields_by_name["raw_input_contents"].number == 7


@pytest.mark.external  # TorchServe's wheel, from PyPI
def test_wire_json_compatible_with_torchserves_proto(tmp_path):
    """``buf breaking`` (WIRE_JSON) both ways between protos/open_inference_grpc.proto and TorchServe
    0.12.0's own (from its wheel), and the check catches a moved field number."""
    theirs, ours = tmp_path / "torchserve", tmp_path / "ours"
    extract_torchserve_protos(theirs, ("open_inference_grpc.proto",))
    ours.mkdir()
    shutil.copy(ROOT / "protos" / "open_inference_grpc.proto", ours)
    config = json.dumps({"version": "v2", "breaking": {"use": ["WIRE_JSON"]}})

    def breaking(module: Path, against: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BUF), "breaking", ".", "--against", str(against), "--config", config],
                              cwd=module, capture_output=True, text=True, timeout=60)

    for module, against in ((ours, theirs), (theirs, ours)):
        proc = breaking(module, against)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proto = ours / "open_inference_grpc.proto"
    proto.write_text(proto.read_text().replace("repeated bytes raw_input_contents = 7;",
                                               "repeated bytes raw_input_contents = 9;"))
    moved = breaking(ours, theirs)
    assert moved.returncode != 0 and "raw_input_contents" in moved.stdout
