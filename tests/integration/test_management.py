"""Management API and model loading against a real server."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from conftest import ServerProcess, wait_for
from inference_service._proto import management_pb2


def _code(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kwargs)
    return err.value.code(), err.value.details()


def test_register_mar_infer_unregister(server):
    assert server.register("fn.mar") == 'Model "fn" Version: 1.0 registered with 1 initial workers'
    # module:function entry point: called with data=None at load, then per batch
    assert server.predict("fn", "x") == b"fn:True:x"
    server.unregister("fn")
    assert _code(server.predict, "fn", "x")[0] == grpc.StatusCode.NOT_FOUND


def test_register_tgz_and_directory_with_model_config(server):
    server.register("echo_tgz.tar.gz")
    assert server.predict("echo_tgz", "tgz!") == b"tgz!"
    server.register("echo_dir", initial_workers=0, synchronous=False)
    desc = server.describe("echo_dir")[0]
    # model-config.yaml values apply when the request leaves them unset
    assert desc["batchSize"] == 4 and desc["maxBatchDelay"] == 5000 and desc["minWorkers"] == 1
    server.wait_workers("echo_dir", 1)
    server.unregister("echo_tgz")
    server.unregister("echo_dir")


def test_request_fields_override_model_config(server):
    server.register("echo_dir", batch_size=2, max_batch_delay=50, response_timeout=7, initial_workers=1)
    desc = server.describe("echo_dir")[0]
    assert (desc["batchSize"], desc["maxBatchDelay"], desc["responseTimeout"]) == (2, 50, 7)
    server.unregister("echo_dir")


def test_dynamic_batching_forms_one_batch(server):
    server.register("echo_dir", batch_size=4, max_batch_delay=10_000)
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        sizes = list(pool.map(lambda _: server.predict("echo_dir", "batch"), range(4)))
    elapsed = time.monotonic() - start
    assert sizes == [b"4"] * 4
    assert elapsed < 8, f"a full batch must go at once, not after max_batch_delay (took {elapsed:.2f}s)"
    # a lone request waits max_batch_delay at most, then goes as a batch of one
    server.unregister("echo_dir")
    server.register("echo_dir", batch_size=4, max_batch_delay=300)
    start = time.monotonic()
    assert server.predict("echo_dir", "batch") == b"1"
    assert 0.25 < time.monotonic() - start < 10
    server.unregister("echo_dir")


def test_stream_request_is_never_batched(server):
    server.register("echo_dir", batch_size=4, max_batch_delay=100)
    assert server.stream("echo_dir", "batch") == [b"1"]
    server.unregister("echo_dir")


def test_versions_and_set_default(server):
    server.register("echo.mar", model_name="multi")
    server.register("echo_v2.mar", model_name="multi")
    versions = server.describe("multi", "all")
    assert sorted(v["modelVersion"] for v in versions) == ["1.0", "2.0"]
    assert server.describe("multi")[0]["modelVersion"] == "1.0"
    server.management.SetDefault(management_pb2.SetDefaultRequest(model_name="multi", model_version="2.0"),
                                 timeout=10)
    assert server.describe("multi")[0]["modelVersion"] == "2.0"
    assert server.predict("multi", "v", version="1.0") == b"v"
    # the default cannot be removed while another version exists (as TorchServe)
    code, details = _code(server.unregister, "multi")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "default" in details
    assert _code(server.management.SetDefault,
                 management_pb2.SetDefaultRequest(model_name="multi", model_version="3.0"))[0] \
        == grpc.StatusCode.NOT_FOUND
    server.unregister("multi", "1.0")
    server.unregister("multi")
    assert _code(server.describe, "multi")[0] == grpc.StatusCode.NOT_FOUND


def test_register_same_version_twice_fails(server):
    server.register("echo.mar", model_name="twice")
    code, details = _code(server.register, "echo.mar", model_name="twice")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already registered" in details
    server.unregister("twice")


def test_scale_workers_up_and_down(server):
    server.register("echo.mar", model_name="scaled", initial_workers=1)
    assert len(server.describe("scaled")[0]["workers"]) == 1
    server.scale("scaled", 3)
    workers = server.wait_workers("scaled", 3)
    assert len({w["pid"] for w in workers}) == 3
    assert server.describe("scaled")[0]["minWorkers"] == 3
    server.scale("scaled", 1)
    server.wait_described("scaled", lambda d: len(d["workers"]) == 1, what="scaled down to one worker")
    assert server.predict("scaled", "still") == b"still"
    server.scale("scaled", 0)
    code, details = _code(server.predict, "scaled", "x")
    assert code == grpc.StatusCode.UNAVAILABLE and "no worker" in details
    server.unregister("scaled")


def test_requests_wait_for_starting_workers(server):
    server.register("echo.mar", model_name="lazy", initial_workers=0, synchronous=False)
    server.scale("lazy", 1, synchronous=False)
    assert server.predict("lazy", "queued until ready") == b"queued until ready"
    server.unregister("lazy")


def test_synchronous_register_of_failing_handler_reports_cause(server):
    code, details = _code(server.register, "broken.mar")
    assert code == grpc.StatusCode.INTERNAL
    assert "weights are corrupt (test)" in details
    assert _code(server.describe, "broken")[0] == grpc.StatusCode.NOT_FOUND
    assert server.predict("echo", "unaffected") == b"unaffected"


def test_base_handler_subclass_loads_eager_model(server):
    server.register("doubler.mar")
    out = json.loads(server.predict("doubler", "[1.5, -2]"))
    assert out == {"doubled": [3.0, -4.0], "model_dir": True}
    # the worker's log lines reach the server's log beside the response, not before it
    wait_for(lambda: "PreprocessTime" in server.log() and "HandlerTime" in server.log(), 10,
             what="the handler's metric log lines")
    server.unregister("doubler")


def test_generator_handler_streams_yields(server):
    server.register("gen.mar")
    assert server.stream("gen", "a b c") == [b"a ", b"b ", b"c ", b"<done>"]
    assert server.predict("gen", "a b") == b"a b <done>"
    server.unregister("gen")


@pytest.mark.parametrize("url,code,text", [
    ("", grpc.StatusCode.INVALID_ARGUMENT, "url is required"),
    ("missing.mar", grpc.StatusCode.NOT_FOUND, "not found"),
    ("../outside.mar", grpc.StatusCode.INVALID_ARGUMENT, "outside the model store"),
    ("/etc/passwd", grpc.StatusCode.INVALID_ARGUMENT, "outside the model store"),
    ("flow.war", grpc.StatusCode.INVALID_ARGUMENT, "workflows are not supported"),
    ("https://example.com/m.mar", grpc.StatusCode.PERMISSION_DENIED, "allowed_urls"),
    ("s3://bucket/m.mar", grpc.StatusCode.INVALID_ARGUMENT, "not supported"),
    ("seq-config.yaml", grpc.StatusCode.INVALID_ARGUMENT, "not a model archive"),
])
def test_register_bad_urls(server, url, code, text):
    got, details = _code(server.register, url)
    assert got == code and text in details


def test_register_bad_fields(server):
    code, details = _code(server.register, "echo.mar", model_name="bad name!")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "invalid model name" in details
    code, details = _code(server.register, "echo.mar", model_name="bad", runtime="java")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, details = _code(server.scale, "echo", -1)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, details = _code(server.management.ScaleWorker, management_pb2.ScaleWorkerRequest(model_name="nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    code, details = _code(server.management.DescribeModel, management_pb2.DescribeModelRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_list_models_sorted_and_paginated(server):
    for name in ("zeta", "alpha", "mid"):
        server.register("echo.mar", model_name=name, initial_workers=0)
    full = json.loads(server.management.ListModels(management_pb2.ListModelsRequest(), timeout=10).msg)
    names = [m["modelName"] for m in full["models"]]
    assert names == sorted(names) and {"alpha", "mid", "zeta", "echo"} <= set(names)
    assert "nextPageToken" not in full
    page = json.loads(server.management.ListModels(management_pb2.ListModelsRequest(limit=2), timeout=10).msg)
    assert [m["modelName"] for m in page["models"]] == names[:2]
    rest = json.loads(server.management.ListModels(
        management_pb2.ListModelsRequest(limit=2, next_page_token=int(page["nextPageToken"])), timeout=10).msg)
    assert [m["modelName"] for m in rest["models"]] == names[2:4]
    # as TorchServe's ApiUtils.getModelList: a limit outside 1..100 is 100, a negative token 0
    for limit, token in ((5000, 0), (-1, 0), (2, -1)):
        clamped = json.loads(server.management.ListModels(
            management_pb2.ListModelsRequest(limit=limit, next_page_token=token), timeout=10).msg)
        assert [m["modelName"] for m in clamped["models"]] == (names[:2] if limit == 2 else names)
    for name in ("zeta", "alpha", "mid"):
        server.unregister(name)


def test_negative_fields_are_unset_as_in_torchserve(server):
    """TorchServe's gRPC RegisterModel reads a number at or below 0 as unset
    (``GRPCUtils.getRegisterParam``), and its ScaleWorker ignores number_gpu; its own
    management test data registers with ``initial_workers=-1`` and scales with
    ``number_gpu=-1``: both still work. A negative batch size, batch delay or timeout is
    refused, naming the field (issue 34, item 8)."""
    for field in ("batch_size", "max_batch_delay", "response_timeout", "startup_timeout"):
        with pytest.raises(grpc.RpcError) as caught:
            server.register("echo.mar", model_name="negatives", **{field: -1})
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith(f"{field} must be 0 (unset) or from"), caught.value.details()
    msg = server.register("echo.mar", model_name="negatives", initial_workers=-1, synchronous=True)
    assert "negatives" in msg
    desc = server.describe("negatives")[0]
    assert desc["batchSize"] == 1 and desc["responseTimeout"] > 0 and desc["startupTimeout"] > 0
    server.management.ScaleWorker(management_pb2.ScaleWorkerRequest(
        model_name="negatives", min_worker=1, number_gpu=-1, synchronous=True), timeout=60)
    assert len(server.describe("negatives")[0]["workers"]) == 1
    server.unregister("negatives")


def test_describe_has_torchserve_keys(server):
    desc = server.describe("echo")
    assert isinstance(desc, list) and len(desc) == 1
    keys = {"modelName", "modelVersion", "modelUrl", "runtime", "minWorkers", "maxWorkers", "batchSize",
            "maxBatchDelay", "responseTimeout", "startupTimeout", "maxRetryTimeoutInSec", "deviceType",
            "loadedAtStartup", "workers", "jobQueueStatus"}
    assert keys <= set(desc[0])
    assert desc[0]["loadedAtStartup"] is True
    assert set(desc[0]["jobQueueStatus"]) == {"remainingCapacity", "pendingRequests"}
    worker = desc[0]["workers"][0]
    assert {"id", "startTime", "status", "memoryUsage", "pid", "gpu", "gpuUsage"} <= set(worker)


def test_model_api_disabled_by_default(store, tmp_path):
    srv = ServerProcess(tmp_path, store, ["--models", "echo=echo.mar", "--workers-per-model", "1"])
    try:
        code, details = _code(srv.register, "fn.mar")
        assert code == grpc.StatusCode.PERMISSION_DENIED and "Model API disabled" in details
        code, _ = _code(srv.unregister, "echo")
        assert code == grpc.StatusCode.PERMISSION_DENIED
        srv.wait_workers("echo", 1)
        assert srv.predict("echo", "startup models still load") == b"startup models still load"
    finally:
        assert srv.stop() == 0
