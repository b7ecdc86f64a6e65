"""Server reflection on both ports: tools like grpcurl work without the proto files."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from conftest import ServerProcess


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    """This module only reads: tests/conftest.py's session-wide echo server."""
    return shared_server


INFERENCE = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
MANAGEMENT = "org.pytorch.serve.grpc.management.ManagementAPIsService"


def test_reflection_lists_and_resolves_services(server):
    db = ProtoReflectionDescriptorDatabase(server.channel)
    services = set(db.get_services())
    assert {INFERENCE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    pool = DescriptorPool(db)
    service = pool.FindServiceByName(INFERENCE)
    assert [m.name for m in service.methods] == ["Ping", "Predictions", "StreamPredictions", "StreamPredictions2"]
    predictions = service.FindMethodByName("StreamPredictions2")
    assert predictions.input_type.full_name == "org.pytorch.serve.grpc.inference.PredictionsRequest"
    assert predictions.output_type.fields_by_name["status"].message_type.full_name == "google.rpc.Status"

    mdb = ProtoReflectionDescriptorDatabase(server.mchannel)
    assert MANAGEMENT in set(mdb.get_services())
    methods = [m.name for m in DescriptorPool(mdb).FindServiceByName(MANAGEMENT).methods]
    assert sorted(methods) == ["DescribeModel", "ListModels", "RegisterModel", "ScaleWorker", "SetDefault",
                               "UnregisterModel"]
