"""Property-based tests: random and malformed requests to every RPC never hurt the server."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import empty_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ServerProcess, build_mar
from inference_service._proto import inference_pb2, management_pb2

# Every status this server documents for these RPCs.
DOCUMENTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS,
}
INT32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, 1, 65, 1001, 2**31 - 1]))
NAMES = st.one_of(st.sampled_from(["", "lengths", "echo", "lengths.mar", "../x", "a" * 300, "\u00e9\u00e8", " "]),
                  st.text(max_size=50))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fsrv(store, tmp_path_factory):
    build_mar(store, "lengths", "len_handler.py")
    srv = ServerProcess(tmp_path_factory.mktemp("fuzz"), store,
                        ["--enable-model-api", "--models", "lengths=lengths.mar", "--workers-per-model", "1"])
    srv.wait_workers("lengths", 1)
    yield srv
    # the server kept serving through it all
    assert srv.predict("lengths", "abc") == b'{"data": 3}'
    assert "Healthy" in srv.inference.Ping(empty_pb2.Empty(), timeout=5).health
    assert srv.stop() == 0


def _call(fn, request, stream: bool = False) -> grpc.StatusCode:
    try:
        out = fn(request, timeout=20)
        if stream:
            list(out)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


@SETTINGS
@given(name=NAMES, version=st.text(max_size=20),
       inputs=st.dictionaries(st.text(max_size=20), st.binary(max_size=200), max_size=5),
       seq=st.one_of(st.none(), st.text(max_size=40)))
def test_inference_rpcs(fsrv, name, version, inputs, seq):
    req = inference_pb2.PredictionsRequest(model_name=name, model_version=version, input=inputs)
    if seq is not None:
        req.sequence_id = seq
    assert _call(fsrv.inference.Predictions, req) in DOCUMENTED
    assert _call(fsrv.inference.StreamPredictions, req, stream=True) in DOCUMENTED
    responses = list(fsrv.inference.StreamPredictions2(iter([req, req]), timeout=20))
    assert len(responses) == 2
    for response in responses:
        if response.HasField("status"):
            assert grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == response.status.code)) \
                in DOCUMENTED


@SETTINGS
@given(url=NAMES, name=NAMES, handler=st.sampled_from(["", "nope.py", "x:y"]),
       ints=st.lists(INT32, min_size=5, max_size=5), sync=st.booleans())
def test_register_model(fsrv, url, name, handler, ints, sync):
    req = management_pb2.RegisterModelRequest(
        url=url, model_name=name, handler=handler, batch_size=ints[0], max_batch_delay=ints[1],
        initial_workers=min(ints[2], 2) if ints[2] >= 0 else ints[2], response_timeout=ints[3],
        startup_timeout=ints[4], synchronous=sync)
    code = _call(fsrv.management.RegisterModel, req)
    assert code in DOCUMENTED | {grpc.StatusCode.INTERNAL}  # INTERNAL only: a handler failed to load
    if code == grpc.StatusCode.OK:  # a random request that is valid: clean it up
        target = name or "lengths"
        fsrv.management.ScaleWorker(management_pb2.ScaleWorkerRequest(model_name=target, min_worker=0), timeout=20)
        version = fsrv.describe(target, "all")[-1]["modelVersion"]
        if target != "lengths":
            fsrv.unregister(target, version)


@SETTINGS
@given(name=NAMES.filter(lambda n: n != "lengths"), version=st.text(max_size=10),
       ints=st.lists(INT32, min_size=5, max_size=5), sync=st.booleans())
def test_management_rpcs(fsrv, name, version, ints, sync):
    calls = [
        (fsrv.management.ScaleWorker, management_pb2.ScaleWorkerRequest(
            model_name=name, model_version=version, max_worker=ints[0], min_worker=ints[1], number_gpu=ints[2],
            synchronous=sync, timeout=ints[3])),
        (fsrv.management.DescribeModel, management_pb2.DescribeModelRequest(model_name=name, model_version=version)),
        (fsrv.management.ListModels, management_pb2.ListModelsRequest(limit=ints[3], next_page_token=ints[4])),
        (fsrv.management.SetDefault, management_pb2.SetDefaultRequest(model_name=name, model_version=version)),
        (fsrv.management.UnregisterModel, management_pb2.UnregisterModelRequest(model_name=name,
                                                                                model_version=version)),
    ]
    for fn, req in calls:
        assert _call(fn, req) in DOCUMENTED


def test_scale_serving_model_out_of_range(fsrv):
    for bad in (-1, 65, 2**31 - 1):
        code = _call(fsrv.management.ScaleWorker, management_pb2.ScaleWorkerRequest(model_name="lengths",
                                                                                    min_worker=bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_invalid_utf8_in_name_is_rejected_cleanly(fsrv):
    # hand-built PredictionsRequest: field 1 (model_name) holding invalid UTF-8
    raw = b"\x0a\x03\xff\xfe\xfd"
    call = fsrv.channel.unary_unary("/org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions",
                                    request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        call(raw, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in err.value.details()
    stream2 = fsrv.channel.stream_stream("/org.pytorch.serve.grpc.inference.InferenceAPIsService/StreamPredictions2",
                                         request_serializer=lambda b: b,
                                         response_deserializer=inference_pb2.PredictionResponse.FromString)
    responses = list(stream2(iter([raw]), timeout=10))
    assert responses[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    manage = fsrv.mchannel.unary_unary("/org.pytorch.serve.grpc.management.ManagementAPIsService/DescribeModel",
                                       request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        manage(raw, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fsrv.predict("lengths", "still fine") == b'{"data": 10}'
