"""``grpc_status_codes=torchserve``: every refusal TorchServe 0.12 defines, answered with its code and message.

TorchServe's own gRPC test files ship in neither its wheel nor an sdist, so the facts they and its
frontend sources hold (the request, TorchServe's code and message) live in
``tests/data/torchserve_grpc_refusals.json``, one row per refusal; each row is sent here to a real
server started with the option (from ``config.properties`` for one server, ``--grpc-status-codes``
for the other), and the default codes are checked to stay as they were.
"""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import ServerProcess, build_dir, wait_for
from inference_service._proto import inference_pb2, management_pb2, open_inference_grpc_pb2

ROWS = json.loads((Path(__file__).resolve().parent.parent / "data" / "torchserve_grpc_refusals.json")
                  .read_text())["rows"]
MANAGEMENT_RPCS = {"RegisterModel", "UnregisterModel", "ScaleWorker", "SetDefault", "DescribeModel", "ListModels"}
OIP_RPCS = {"ModelReady", "ModelMetadata", "ModelInfer"}
REQUESTS = {
    "ModelReady": open_inference_grpc_pb2.ModelReadyRequest,
    "ModelMetadata": open_inference_grpc_pb2.ModelMetadataRequest,
    "ModelInfer": open_inference_grpc_pb2.ModelInferRequest,
    "RegisterModel": management_pb2.RegisterModelRequest, "UnregisterModel": management_pb2.UnregisterModelRequest,
    "ScaleWorker": management_pb2.ScaleWorkerRequest, "SetDefault": management_pb2.SetDefaultRequest,
    "DescribeModel": management_pb2.DescribeModelRequest, "ListModels": management_pb2.ListModelsRequest,
}


@pytest.fixture(scope="module")
def ts_store(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Path:
    path = tmp_path_factory.mktemp("ts_store")
    for name in ("echo.mar", "broken.mar"):
        shutil.copy(store / name, path / name)
    build_dir(path, "echo_two", "echo_handler.py", model_name="echo", version="2.0")
    return path


class _ArchiveHost(http.server.BaseHTTPRequestHandler):
    """Serves ``files`` (path -> bytes) over HTTP; 404 for anything else."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def archive_host(ts_store: Path) -> Iterator[str]:
    """A local HTTP server with echo.mar at /ok/echo.mar; its base URL."""
    _ArchiveHost.files = {"/ok/echo.mar": (ts_store / "echo.mar").read_bytes()}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ArchiveHost)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def ts_server(ts_store: Path, archive_host: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The option from config.properties; echo 1.0 and 2.0, zero (no worker), rt (response_timeout 1 s);
    archives may be downloaded from ``archive_host``'s /ok/."""
    work = tmp_path_factory.mktemp("ts_codes")
    config = work / "config.properties"
    pattern = archive_host.replace(".", "\\\\.") + "/ok/.*"  # properties escape: \\. is the regex \.
    config.write_text(f"grpc_status_codes=torchserve\nenable_model_api=true\nallowed_urls={pattern}\n")
    srv = ServerProcess(work, ts_store,
                        ["--ts-config", str(config), "--models", "echo=echo.mar", "--workers-per-model", "1"])
    srv.archive_host = archive_host  # type: ignore[attr-defined]
    try:
        srv.wait_workers("echo", 1)
        srv.register("echo_two", initial_workers=1)
        srv.register("echo.mar", model_name="zero", initial_workers=0)
        srv.register("echo.mar", model_name="rt", initial_workers=1, response_timeout=1)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def ts_locked(ts_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The option from the command line, model API off."""
    srv = ServerProcess(tmp_path_factory.mktemp("ts_locked"), ts_store,
                        ["--grpc-status-codes", "torchserve", "--models", "echo=echo.mar", "--workers-per-model", "1"])
    try:
        srv.wait_workers("echo", 1)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _request(row: dict[str, Any], archive_host: str = "") -> Any:
    fields = dict(row["request"])
    if "url" in fields:
        fields["url"] = fields["url"].replace("{archive_host}", archive_host)
    if row["rpc"] in MANAGEMENT_RPCS | OIP_RPCS:
        return REQUESTS[row["rpc"]](**fields)
    fields["input"] = {k: v.encode() for k, v in fields.get("input", {}).items()}
    return inference_pb2.PredictionsRequest(**fields)


def _call(srv: ServerProcess, row: dict[str, Any]) -> tuple[grpc.StatusCode, str, Any]:
    """Send the row's request; returns the call's code and message (and the one reply of a StreamPredictions2)."""
    rpc, request = row["rpc"], _request(row, getattr(srv, "archive_host", ""))
    management = rpc in MANAGEMENT_RPCS
    token = row.get("token")
    metadata: tuple[tuple[str, str], ...] = ()
    if token is None:
        channel = srv.mchannel if management else srv.channel
    else:
        channel = srv.open_channel(srv.management_port if management else srv.inference_port, None)
        metadata = (("authorization", "Bearer not-the-key"),) if token == "wrong" else ()
    service = ("management.ManagementAPIsService" if management else "openinference.GRPCInferenceService"
               if rpc in OIP_RPCS else "inference.InferenceAPIsService")
    path = f"/org.pytorch.serve.grpc.{service}/{rpc}"
    response_type = (management_pb2.ManagementResponse if management else
                     getattr(open_inference_grpc_pb2, f"{rpc}Response") if rpc in OIP_RPCS
                     else inference_pb2.PredictionResponse)
    kwargs = {"request_serializer": type(request).SerializeToString, "response_deserializer": response_type.FromString}
    try:
        if rpc == "StreamPredictions2":
            replies = list(channel.stream_stream(path, **kwargs)(iter([request]), timeout=60, metadata=metadata))
            return grpc.StatusCode.OK, "", replies[0]
        if rpc == "StreamPredictions":
            list(channel.unary_stream(path, **kwargs)(request, timeout=60, metadata=metadata))
        else:
            channel.unary_unary(path, **kwargs)(request, timeout=60, metadata=metadata)
        return grpc.StatusCode.OK, "", None
    except grpc.RpcError as err:
        return err.code(), err.details() or "", None
    finally:
        if token is not None:
            channel.close()


def _check(srv: ServerProcess, row: dict[str, Any]) -> None:
    code, message, reply = _call(srv, row)
    if row.get("in_band"):
        assert reply is not None and code == grpc.StatusCode.OK
        code = next(c for c in grpc.StatusCode if c.value[0] == reply.status.code)
        message = reply.status.message
    assert code.name == row["code"], (row["refusal"], code, message)
    if "message" in row:
        assert message == row["message"].replace("{archive_host}", getattr(srv, "archive_host", "")), row["refusal"]
    assert message.startswith(row.get("message_starts", "")), (row["refusal"], message)
    assert message.endswith(row.get("message_ends", "")), (row["refusal"], message)


def test_every_refusal_answers_torchserves_code_and_message(ts_server: ServerProcess) -> None:
    rows = [r for r in ROWS if "server" not in r]
    assert len(rows) >= 30
    for row in rows:
        if row["request"].get("model_name") == "echo" and row["rpc"] in ("Predictions", "ScaleWorker"):
            ts_server.wait_workers("echo", 1, timeout=60)  # after "exit" the worker is being replaced
        _check(ts_server, row)
    # the refused calls changed nothing: both echo versions are there, 1.0 the default
    versions = {d["modelVersion"]: d for d in ts_server.describe("echo", "all")}
    assert set(versions) == {"1.0", "2.0"}
    assert ts_server.predict("echo", "still here") == b"still here"


def test_model_api_and_token_refusals(ts_locked: ServerProcess) -> None:
    rows = [r for r in ROWS if r.get("server") == "model_api_disabled"]
    assert {r.get("token") for r in rows} == {None, "none", "wrong"}
    for row in rows:
        _check(ts_locked, row)
    assert ts_locked.predict("echo", "x") == b"x"


def test_default_codes_unchanged(server: ServerProcess) -> None:
    """Without the option the same refusals keep this server's codes (README, Error details)."""
    by_refusal = {r["refusal"]: r for r in ROWS}
    expected = {
        "inference on an unknown model": grpc.StatusCode.NOT_FOUND,
        "inference without model_name": grpc.StatusCode.INVALID_ARGUMENT,
        "the handler raises": grpc.StatusCode.INTERNAL,
        "RegisterModel of a version registered already": grpc.StatusCode.FAILED_PRECONDITION,
        "SetDefault without model_version": grpc.StatusCode.INVALID_ARGUMENT,
        "ScaleWorker with max_worker below min_worker": grpc.StatusCode.INVALID_ARGUMENT,
        "none: ScaleWorker with min_worker -1 (read as 1)": grpc.StatusCode.INVALID_ARGUMENT,
    }
    for refusal, code in expected.items():
        got, message, _ = _call(server, by_refusal[refusal])
        assert got == code, (refusal, got, message)
        assert "org.pytorch.serve" not in message
    wait_for(lambda: server.predict("echo", "x") == b"x", 30, what="echo still serves")

