"""Failing RPCs carry google.rpc.Status details: ErrorInfo with a stable reason, RetryInfo when useful."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from inference_service._proto import management_pb2


def _details(fn, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kwargs)
    status = rpc_status.from_call(err.value)
    assert status is not None and status.code == err.value.code().value[0]
    assert status.message == err.value.details()
    info, retry = None, None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
    assert info is not None and info.domain == "inference-service"
    return err.value.code(), info, retry


def test_not_found_names_the_model(server):
    code, info, retry = _details(server.predict, "nope", "x", version="3.0")
    assert code == grpc.StatusCode.NOT_FOUND and info.reason == "MODEL_NOT_FOUND"
    assert info.metadata["model_name"] == "nope" and info.metadata["model_version"] == "3.0"
    assert retry is None


def test_handler_error_reason(server):
    code, info, retry = _details(server.predict, "echo", "boom")
    assert code == grpc.StatusCode.INTERNAL and info.reason == "HANDLER_ERROR" and retry is None


def test_no_worker_is_retryable(server):
    server.register("echo.mar", model_name="zero", initial_workers=0)
    code, info, retry = _details(server.predict, "zero", "x")
    assert code == grpc.StatusCode.UNAVAILABLE and info.reason == "NO_WORKER"
    assert retry is not None and retry.retry_delay.ToMilliseconds() > 0
    server.unregister("zero")


def test_invalid_argument_and_management_reasons(server):
    code, info, _ = _details(server.management.DescribeModel, management_pb2.DescribeModelRequest(), timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and info.reason == "MODEL_NAME_REQUIRED"
    code, info, _ = _details(server.register, "broken.mar")
    assert info.reason == "MODEL_LOAD_FAILED"


def test_status_set_by_handler_has_its_own_reason(server):
    code, info, _ = _details(server.predict, "echo", "status:404")
    assert code == grpc.StatusCode.NOT_FOUND and info.reason == "HANDLER_STATUS"
