"""Unit tests of the Open Inference Protocol's pieces without a server: the tensor codec (every data
type, raw layout, shape and range checks), the JSON body a handler gets, the checks of a handler's
answer, the HTTP body parser (binary tensor data extension) and the proto conversions."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading

import pytest

from inference_service._proto import grpc_predict_v2_pb2 as kserve_pb2
from inference_service._proto import open_inference_grpc_pb2 as ts_pb2
from inference_service.errors import HandlerError, InvalidArgument
from inference_service.frontends.grpc.open_inference import infer_request, infer_response
from inference_service.frontends.oip.http import request_from_http, response_to_http
from inference_service.frontends.oip.protocol import (
    OFFLOAD_SIZE,
    InferRequest,
    RequestedOutput,
    convert,
    make_input,
    parse_answer,
    select_outputs,
)
from inference_service.frontends.oip.tensors import DATATYPES, decode_raw, element_count, encode_raw, flatten

SAMPLES = {
    "BOOL": [True, False, True],
    "UINT8": [0, 255, 7], "UINT16": [0, 65535, 9], "UINT32": [0, 2**32 - 1, 3], "UINT64": [0, 2**64 - 1, 5],
    "INT8": [-128, 127, 0], "INT16": [-32768, 32767, 1], "INT32": [-(2**31), 2**31 - 1, 2],
    "INT64": [-(2**63), 2**63 - 1, -4],
    "FP16": [0.5, -1.5, 2.0], "FP32": [1.5, -2.25, 0.0], "FP64": [1e300, -0.1, 3.0],
    "BF16": [1.0, -2.0, 0.5],
    "BYTES": [b"a", b"", b"\x00\xffz"],
}


@pytest.mark.parametrize("name", sorted(DATATYPES))
def test_raw_roundtrip_every_datatype(name):
    dtype = DATATYPES[name]
    raw = encode_raw(dtype, SAMPLES[name], "t", HandlerError)
    if name != "BYTES":
        assert len(raw) == 3 * dtype.itemsize
    assert decode_raw(dtype, raw, 3, "t", InvalidArgument) == SAMPLES[name]


def test_raw_layout_is_little_endian_and_bytes_are_length_prefixed():
    assert encode_raw(DATATYPES["INT32"], [1, -2], "t", HandlerError) == b"\x01\x00\x00\x00\xfe\xff\xff\xff"
    assert encode_raw(DATATYPES["FP32"], [1.0], "t", HandlerError) == struct.pack("<f", 1.0)
    assert encode_raw(DATATYPES["BYTES"], ["hé", b"x"], "t", HandlerError) == (
        b"\x03\x00\x00\x00h\xc3\xa9" + b"\x01\x00\x00\x00x")
    # BF16 is the upper half of the float32 pattern; BOOL any non-zero byte
    assert encode_raw(DATATYPES["BF16"], [1.0], "t", HandlerError) == b"\x80\x3f"
    assert decode_raw(DATATYPES["BOOL"], b"\x00\x02", 2, "t", InvalidArgument) == [False, True]


@pytest.mark.parametrize(("name", "raw", "count", "needle"), [
    ("FP32", b"\x00" * 7, 2, "7 raw bytes do not hold 2 FP32 elements"),
    ("INT64", b"\x00" * 16, 1, "8 bytes expected"),
    ("BYTES", b"\x05\x00\x00\x00ab", 1, "claims 5 bytes, 2 remain"),
    ("BYTES", b"\x01\x00", 1, "inside an element's 4-byte length"),
    ("BYTES", b"\x01\x00\x00\x00a\x01\x00\x00\x00b", 1, "holds 2 elements, the shape 1"),
])
def test_raw_size_mismatch_is_invalid_argument(name, raw, count, needle):
    with pytest.raises(InvalidArgument, match=needle):
        decode_raw(DATATYPES[name], raw, count, "input 'x'", InvalidArgument)


def test_shapes_and_flatten():
    assert element_count([2, 3], InvalidArgument) == 6
    assert element_count([], InvalidArgument) == 1
    assert element_count([4, 0], InvalidArgument) == 0
    for bad in ([-1, 2], [1.5], [True]):
        with pytest.raises(InvalidArgument, match="invalid shape"):
            element_count(bad, InvalidArgument, "input 'x'")
    assert flatten([[1, [2, 3]], [], 4]) == [1, 2, 3, 4]
    assert flatten(5) == [5]
    assert flatten([1, 2]) == [1, 2]


@pytest.mark.parametrize(("dtype", "data", "needle"), [
    ("FP32", [1.0, "x"], r"element 1 \('x'\) is not a number"),
    ("INT8", [128], r"element 0 \(128\) is out of range for INT8"),
    ("UINT32", [-1], "out of range for UINT32"),
    ("INT64", [1.5], "is not an integer"),
    ("INT64", [True], "is not an integer"),
    ("BOOL", [1], "is not a boolean"),
    ("BYTES", [3], "is not a string"),
    ("FP99", [1.0], "unknown datatype 'FP99'"),
])
def test_json_elements_are_checked(dtype, data, needle):
    with pytest.raises(InvalidArgument, match=needle):
        make_input("x", dtype, [len(data)], data, typed=False)


def test_make_input_checks_shape_against_data():
    with pytest.raises(InvalidArgument, match=r"shape \[2, 2\] holds 4 elements, got 3"):
        make_input("x", "FP32", [2, 2], [1.0, 2.0, 3.0], typed=False)
    with pytest.raises(InvalidArgument, match="input 3 has no name"):
        make_input("", "FP32", [1], [1.0], typed=False, index=3)
    tensor = make_input("x", "FP32", [2], [1, 2.5], typed=False)
    assert tensor.data == [1.0, 2.5] and all(isinstance(v, float) for v in tensor.data)


def test_handler_body_is_torchserves_json():
    request = InferRequest("m", "", "7", [
        make_input("a", "FP32", [2], [1.5, 2.5], typed=True),
        make_input("s", "BYTES", [2], [b"hi", "text"], typed=True, parameters={"binary_data_size": 9, "k": 1}),
    ], [RequestedOutput("o", {"binary_data": True})], {"binary_data_output": True, "temperature": 2})
    body = json.loads(request.handler_body())
    assert body == {
        "id": "7", "model_name": "m",
        "inputs": [{"name": "a", "shape": [2], "datatype": "FP32", "data": [1.5, 2.5]},
                   {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["aGk=", "text"], "parameters": {"k": 1}}],
        "parameters": {"temperature": 2},
        "outputs": [{"name": "o"}],
    }


def _request() -> InferRequest:
    return InferRequest("m", "", "rid", [make_input("a", "FP32", [1], [1.0], typed=True)])


def test_parse_answer_fills_in_and_flattens():
    answer = {"outputs": [{"name": "o", "datatype": "INT64", "shape": [2, 2], "data": [[1, 2], [3, 4]]},
                          {"name": "t", "datatype": "BYTES", "shape": [2], "data": ["x", {"k": 1}]}]}
    response = parse_answer(json.dumps(answer).encode(), _request(), "1.0")
    assert (response.id, response.model_name, response.model_version) == ("rid", "m", "1.0")
    assert response.outputs[0].data == [1, 2, 3, 4]
    assert response.outputs[1].data == ["x", '{"k": 1}']


@pytest.mark.parametrize(("payload", "needle"), [
    (b"plain text", "not JSON"),
    (b'{"id": "x"}', 'no "outputs" list'),
    (b'{"outputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}', "output 0 has no name"),
    (b'{"outputs": [{"name": "o", "datatype": "FP32", "shape": [3], "data": [1]}]}', r"shape \[3\] holds 3"),
    (b'{"outputs": [{"name": "o", "datatype": "HALF", "shape": [1], "data": [1]}]}', "unknown datatype"),
    (b'{"outputs": [{"name": "o", "datatype": "INT8", "shape": [1], "data": [300]}]}', "out of range"),
    (b'{"outputs": [{"name": "o", "datatype": "FP32", "shape": [1]}]}', "has no data"),
])
def test_parse_answer_refuses_what_is_not_a_v2_response(payload, needle):
    with pytest.raises(HandlerError, match=needle):
        parse_answer(payload, _request(), "1.0")


def test_select_outputs():
    response = parse_answer(json.dumps({"outputs": [
        {"name": "a", "datatype": "BOOL", "shape": [1], "data": [True]},
        {"name": "b", "datatype": "BOOL", "shape": [1], "data": [False]}]}).encode(), _request(), "1")
    assert [t.name for t in select_outputs(response, [RequestedOutput("b")])] == ["b"]
    assert [t.name for t in select_outputs(response, [])] == ["a", "b"]
    with pytest.raises(InvalidArgument, match=r"requested outputs \['c'\] are not produced"):
        select_outputs(response, [RequestedOutput("c")])


# --------------------------------------------------------------------------- HTTP bodies
def test_http_json_body():
    body = json.dumps({"id": "q", "parameters": {"p": 1}, "outputs": [{"name": "o"}], "inputs": [
        {"name": "x", "datatype": "INT64", "shape": [2, 2], "data": [[1, 2], [3, 4]]},
        {"name": "s", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]}).encode()
    request = request_from_http(body, None, "m", "2.0")
    assert (request.model_name, request.model_version, request.id) == ("m", "2.0", "q")
    assert request.inputs[0].data == [1, 2, 3, 4] and request.inputs[1].data == ["hello"]
    assert json.loads(request.handler_body())["inputs"][1]["data"] == ["hello"]  # JSON text stays text
    assert request.outputs[0].name == "o" and request.parameters == {"p": 1}


def test_http_binary_tensor_data():
    head = json.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
        {"name": "j", "datatype": "INT32", "shape": [1], "data": [5]},
        {"name": "s", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}}]}).encode()
    body = head + struct.pack("<2f", 1.5, 2.5) + b"\x02\x00\x00\x00hi"
    request = request_from_http(body, str(len(head)), "m", "")
    assert [t.data for t in request.inputs] == [[1.5, 2.5], [5], [b"hi"]]
    assert json.loads(request.handler_body())["inputs"][2]["data"] == [base64.b64encode(b"hi").decode()]
    with pytest.raises(InvalidArgument, match="1 bytes of binary data belong to no input"):
        request_from_http(body + b"!", str(len(head)), "m", "")
    with pytest.raises(InvalidArgument, match="exceeds the"):
        request_from_http(body[:-1], str(len(head)), "m", "")
    with pytest.raises(InvalidArgument, match="is not a length within the body"):
        request_from_http(body, "-3", "m", "")


@pytest.mark.parametrize(("body", "needle"), [
    (b"{", "not JSON"), (b"[]", "not a JSON object"), (b"{}", 'no "inputs" list'),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}', "neither data nor binary_data_size"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}', r"holds 2 elements, got 1"),
])
def test_http_bad_bodies(body, needle):
    with pytest.raises(InvalidArgument, match=needle):
        request_from_http(body, None, "m", "")


def test_http_answer_json_or_binary():
    answer = json.dumps({"id": "q", "outputs": [
        {"name": "a", "datatype": "FP32", "shape": [1], "data": [0.5]},
        {"name": "b", "datatype": "BYTES", "shape": [1], "data": ["hé"]}]}).encode()
    plain = request_from_http(b'{"inputs": []}', None, "m", "")
    response = response_to_http(plain, parse_answer(answer, plain, "1"))
    assert response.content_type == "application/json"
    assert json.loads(response.body)["outputs"][1] == {"name": "b", "datatype": "BYTES", "shape": [1], "data": ["hé"]}
    binary = request_from_http(b'{"inputs": [], "parameters": {"binary_data_output": true}, '
                               b'"outputs": [{"name": "a", "parameters": {"binary_data": false}}, {"name": "b"}]}',
                               None, "m", "")
    response = response_to_http(binary, parse_answer(answer, binary, "1"))
    length = int(response.headers["Inference-Header-Content-Length"])
    head = json.loads(response.body[:length])
    assert head["outputs"][0]["data"] == [0.5]
    assert head["outputs"][1]["parameters"] == {"binary_data_size": 7} and "data" not in head["outputs"][1]
    assert response.body[length:] == b"\x03\x00\x00\x00h\xc3\xa9"


# --------------------------------------------------------------------------- protos
@pytest.mark.parametrize("pb2", [kserve_pb2, ts_pb2])
def test_proto_typed_and_raw(pb2):
    typed = pb2.ModelInferRequest(model_name="m", id="1")
    tensor = typed.inputs.add(name="x", datatype="UINT8", shape=[2])
    tensor.contents.uint_contents.extend([1, 255])
    typed.parameters["flag"].bool_param = True
    tensor.parameters["n"].int64_param = 3
    request = infer_request(typed)
    assert request.inputs[0].data == [1, 255] and request.parameters == {"flag": True}
    assert request.inputs[0].parameters == {"n": 3}
    tensor.contents.uint_contents.append(256)
    tensor.shape[0] = 3
    with pytest.raises(InvalidArgument, match="out of range for UINT8"):
        infer_request(typed)

    raw = pb2.ModelInferRequest(model_name="m")
    raw.inputs.add(name="h", datatype="FP16", shape=[2])
    raw.raw_input_contents.append(struct.pack("<2e", 0.5, 1.5))
    assert infer_request(raw).inputs[0].data == [0.5, 1.5]
    raw.inputs[0].contents.fp32_contents.append(1.0)
    with pytest.raises(InvalidArgument, match="sets contents while the request uses raw_input_contents"):
        infer_request(raw)
    raw.raw_input_contents.append(b"")
    with pytest.raises(InvalidArgument, match="raw_input_contents has 2 entries for 1 inputs"):
        infer_request(raw)
    half = pb2.ModelInferRequest(model_name="m")
    half.inputs.add(name="h", datatype="FP16", shape=[1])
    with pytest.raises(InvalidArgument, match="FP16 data can only be sent in raw_input_contents"):
        infer_request(half)


@pytest.mark.parametrize("pb2", [kserve_pb2, ts_pb2])
def test_proto_answer_typed_unless_raw_asked_or_needed(pb2):
    answer = {"outputs": [{"name": "i", "datatype": "INT16", "shape": [2], "data": [-1, 2]},
                          {"name": "s", "datatype": "BYTES", "shape": [1], "data": ["ok"]}],
              "parameters": {"a": True, "b": 2, "c": "x", "d": 1.5}}
    response = parse_answer(json.dumps(answer).encode(), _request(), "1")
    typed = infer_response(pb2, response, raw=False)
    assert list(typed.outputs[0].contents.int_contents) == [-1, 2]
    assert list(typed.outputs[1].contents.bytes_contents) == [b"ok"] and not typed.raw_output_contents
    assert typed.parameters["d"].string_param == "1.5" and typed.parameters["b"].int64_param == 2
    raw = infer_response(pb2, response, raw=True)
    assert list(raw.raw_output_contents) == [struct.pack("<2h", -1, 2), b"\x02\x00\x00\x00ok"]
    assert not raw.outputs[0].HasField("contents")
    answer["outputs"].append({"name": "h", "datatype": "FP16", "shape": [1], "data": [0.5]})
    needs_raw = infer_response(pb2, parse_answer(json.dumps(answer).encode(), _request(), "1"), raw=False)
    assert len(needs_raw.raw_output_contents) == 3
    overflow = {"outputs": [{"name": "h", "datatype": "FP16", "shape": [1], "data": [1e10]}]}
    with pytest.raises(HandlerError, match="do not fit FP16"):
        infer_response(pb2, parse_answer(json.dumps(overflow).encode(), _request(), "1"), raw=True)


def test_large_conversions_leave_the_event_loop():
    async def main() -> tuple[str, str]:
        small = await convert(lambda: threading.current_thread().name, size=OFFLOAD_SIZE - 1)
        large = await convert(lambda: threading.current_thread().name, size=OFFLOAD_SIZE)
        return small, large

    small, large = asyncio.run(main())
    assert small == threading.main_thread().name and large != small
