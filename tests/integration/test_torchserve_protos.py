"""Wire compatibility, not self-certified: TorchServe 0.12.0's own protos drive this server.

The test downloads the ``torchserve==0.12.0`` wheel from PyPI (cached under
``.cache/``), takes ``inference.proto`` and ``management.proto`` out of the
``model-server.jar`` inside it (nothing of TorchServe is committed here),
generates Python stubs from them with grpcio-tools, and runs a client built
only on those stubs against the real server, calling every RPC.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchserve_wheel import extract_torchserve_protos

pytestmark = pytest.mark.external  # TorchServe's wheel, from PyPI

CLIENT = r'''
import collections, json, sys, queue
import grpc
from google.protobuf import empty_pb2
import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc

ip, mp = int(sys.argv[1]), int(sys.argv[2])
keys = json.load(open(sys.argv[3]))  # TorchServe's key_file.json layout
Details = collections.namedtuple("Details", "method timeout metadata credentials wait_for_ready compression")


class Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
             grpc.StreamStreamClientInterceptor):
    """authorization: Bearer <key> on every call, as TorchServe's token authorization expects."""

    def __init__(self, key):
        self.key = key

    def intercept_unary_unary(self, continuation, d, request):
        metadata = list(d.metadata or []) + [("authorization", "Bearer " + self.key)]
        return continuation(Details(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready,
                                    d.compression), request)

    intercept_unary_stream = intercept_stream_stream = intercept_unary_unary


inf_channel = grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{ip}"), Bearer(keys["inference"]["key"]))
man_channel = grpc.intercept_channel(grpc.insecure_channel(f"127.0.0.1:{mp}"), Bearer(keys["management"]["key"]))
inf = inference_pb2_grpc.InferenceAPIsServiceStub(inf_channel)
man = management_pb2_grpc.ManagementAPIsServiceStub(man_channel)
out = {}
out["ping"] = inf.Ping(empty_pb2.Empty(), timeout=10).health
out["register"] = man.RegisterModel(management_pb2.RegisterModelRequest(
    url="echo.mar", model_name="ts_echo", initial_workers=1, synchronous=True), timeout=60).msg
out["register_v2"] = man.RegisterModel(management_pb2.RegisterModelRequest(
    url="echo_v2.mar", model_name="ts_echo", initial_workers=1, synchronous=True), timeout=60).msg
out["list"] = man.ListModels(management_pb2.ListModelsRequest(limit=10), timeout=10).msg
out["scale"] = man.ScaleWorker(management_pb2.ScaleWorkerRequest(
    model_name="ts_echo", min_worker=2, max_worker=2, synchronous=True), timeout=60).msg
out["describe"] = man.DescribeModel(management_pb2.DescribeModelRequest(model_name="ts_echo"), timeout=10).msg
out["predict"] = inf.Predictions(inference_pb2.PredictionsRequest(
    model_name="ts_echo", input={"data": b"wire"}), timeout=10).prediction.decode()
out["stream"] = [r.prediction.decode() for r in inf.StreamPredictions(inference_pb2.PredictionsRequest(
    model_name="ts_echo", input={"data": b"stream:2"}), timeout=10)]
reqs = [inference_pb2.PredictionsRequest(model_name="ts_echo", input={"data": b"x"}, sequence_id="s-1")]
resp = list(inf.StreamPredictions2(iter(reqs), timeout=10))
out["stream2"] = [[r.sequence_id, r.status.code, r.status.message] for r in resp]
out["set_default"] = man.SetDefault(management_pb2.SetDefaultRequest(
    model_name="ts_echo", model_version="2.0"), timeout=10).msg
out["unregister_v1"] = man.UnregisterModel(management_pb2.UnregisterModelRequest(
    model_name="ts_echo", model_version="1.0"), timeout=30).msg
out["unregister"] = man.UnregisterModel(management_pb2.UnregisterModelRequest(model_name="ts_echo"), timeout=30).msg
try:
    inf.Predictions(inference_pb2.PredictionsRequest(model_name="ts_echo", input={"data": b"x"}), timeout=10)
except grpc.RpcError as e:
    out["after_unregister"] = e.code().name
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def torchserve_stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ts_stubs")
    extract_torchserve_protos(out)
    import google.rpc.status_pb2
    import grpc_tools

    googleapis = Path(google.rpc.status_pb2.__file__).parents[2]
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    from grpc_tools import protoc

    rc = protoc.main(["protoc", f"-I{out}", f"-I{googleapis}", f"-I{well_known}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(out / "inference.proto"), str(out / "management.proto")])
    assert rc == 0
    (out / "client.py").write_text(CLIENT)
    return out


def test_every_rpc_with_torchserve_generated_stubs(server, torchserve_stubs):
    proc = subprocess.run([sys.executable, str(torchserve_stubs / "client.py"), str(server.inference_port),
                           str(server.management_port), str(server.key_file)], cwd=torchserve_stubs,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert json.loads(out["ping"]) == {"status": "Healthy", "code": 200}
    # TorchServe's plain status texts (ManagementImpl.sendStatusResponse), not JSON
    assert out["register"] == 'Model "ts_echo" Version: 1.0 registered with 1 initial workers'
    assert out["register_v2"] == 'Model "ts_echo" Version: 2.0 registered with 1 initial workers'
    assert "ts_echo" in [m["modelName"] for m in json.loads(out["list"])["models"]]
    assert out["scale"] == "Workers scaled to 2 for model: ts_echo"
    described = json.loads(out["describe"])
    assert described[0]["modelName"] == "ts_echo" and len(described[0]["workers"]) == 2
    assert out["predict"] == "wire"
    assert out["stream"] == ["part0;", "part1;", "end"]
    # echo has no sequence batching: an in-band FAILED_PRECONDITION with the id echoed
    assert out["stream2"][0][0] == "s-1" and out["stream2"][0][1] == 9
    assert out["set_default"] == 'Default version successfully updated for model "ts_echo" to "2.0"'
    assert out["unregister_v1"] == out["unregister"] == 'Model "ts_echo" unregistered'
    assert out["after_unregister"] == "NOT_FOUND"
