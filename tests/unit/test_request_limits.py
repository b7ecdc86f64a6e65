"""The frontends' bounds on request work (frontends/limits.py) and raw tensors kept raw."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from inference_service.config import ConfigError, Settings, apply_properties
from inference_service.errors import InvalidArgument, ResourceExhausted
from inference_service.frontends.limits import (
    JSON_SLICE,
    OFFLOAD_BYTES,
    JsonWriter,
    check_parts,
    json_depth,
    loads_sliced,
    off_loop,
    parse_json,
)
from inference_service.frontends.oip.http import request_from_http
from inference_service.frontends.oip.protocol import InferRequest, check_json_floor, make_input
from inference_service.frontends.oip.tensors import DATATYPES, RawBytesElements, RawElements, raw_elements
from inference_service.observability.loop_lag import METRIC, LoopLagMonitor


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [0, 1, 64])
def test_json_at_the_depth_limit_parses(depth):
    body = _nested(depth) if depth else b"1"
    assert json_depth(parse_json(body, 64)) == depth


@pytest.mark.parametrize("body", [_nested(65), _nested(100_000), b'{"a":' * 70 + b"1" + b"}" * 70,
                                  b'{"a": [' + _nested(64) + b"]}"])
def test_json_beyond_the_depth_limit_is_invalid_argument(body):
    with pytest.raises(InvalidArgument, match="deeper than max_json_depth=64"):
        parse_json(body, 64)


def test_brackets_inside_strings_do_not_count():
    body = json.dumps({"text": "[" * 1000}).encode()
    assert parse_json(body, 2) == {"text": "[" * 1000}


@pytest.mark.parametrize("body", [b"\xff\xfe{", b"{", b'{"a": 1e999999}x', b""])
def test_not_json_is_invalid_argument(body):
    with pytest.raises(InvalidArgument, match="not JSON"):
        parse_json(body, 64)


def test_parts_beyond_the_limit():
    check_parts(1000, 1000, "a multipart body")
    with pytest.raises(InvalidArgument, match="more than max_request_parts=1000 parts") as err:
        check_parts(1001, 1000, "a multipart body")
    assert err.value.reason == "TOO_MANY_PARTS"
    with pytest.raises(InvalidArgument, match="form body of more than max_request_parts=3 fields"):
        check_parts(4, 3, "a form body")


def test_json_writer_matches_json_dumps_and_stops_at_its_limit():
    values = [i / 7 for i in range(3 * JSON_SLICE + 5)]
    out = JsonWriter(10**9, "x")
    out.values(len(values), lambda a, b: values[a:b])
    assert out.getvalue() == json.dumps(values, separators=(",", ":")).encode()
    small = JsonWriter(1000, "the body")
    with pytest.raises(ResourceExhausted, match="the body passes max_request_size=1000 bytes") as err:
        small.values(len(values), lambda a, b: values[a:b])
    assert err.value.reason == "REQUEST_TOO_LARGE"
    assert small.size <= 1000 + len(json.dumps(values[:JSON_SLICE]))  # stopped at the first slice past it


def test_handler_body_is_the_same_json_with_raw_elements_kept_raw():
    floats = [0.5 * i for i in range(20_000)]
    raw = struct.pack(f"<{len(floats)}f", *floats)
    data = raw_elements(DATATYPES["FP32"], raw, len(floats), "x", InvalidArgument)
    assert isinstance(data, RawElements) and data.raw is raw and len(data) == len(floats)
    assert data[10:13] == floats[10:13] and data == floats
    request = InferRequest("m", "", "7", [make_input("a", "FP32", [len(floats)], data, typed=True),
                                          make_input("b", "INT8", [2], [1, -2], typed=True)])
    expected = {"id": "7", "model_name": "m",
                "inputs": [{"name": "a", "shape": [len(floats)], "datatype": "FP32", "data": floats},
                           {"name": "b", "shape": [2], "datatype": "INT8", "data": [1, -2]}]}
    assert request.handler_body() == json.dumps(expected, separators=(",", ":")).encode()
    with pytest.raises(ResourceExhausted, match="max_request_size=4096"):
        request.handler_body(4096)


def test_tensors_that_cannot_fit_as_json_are_refused_before_conversion():
    count = 1_700_000  # 6.8 MB of raw FP32: at least 4 bytes each as JSON
    raw = bytes(4 * count)
    head = json.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [count],
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    tensor = request_from_http(head + raw, str(len(head)), "m", "").inputs[0]
    assert isinstance(tensor.data, RawElements) and len(tensor.data) == count  # nothing decoded
    with pytest.raises(ResourceExhausted, match="above max_request_size=6553500") as err:
        check_json_floor([tensor], 6_553_500)
    assert err.value.reason == "REQUEST_TOO_LARGE"
    check_json_floor([tensor], 4 * count)


def test_off_loop_runs_large_work_in_a_thread():
    async def main() -> tuple[int, int]:
        small = await off_loop(threading.get_ident, size=10)
        large = await off_loop(threading.get_ident, size=10**6)
        return small, large

    small, large = asyncio.run(main())
    assert small == threading.get_ident() != large


def test_loop_lag_is_measured_and_the_holder_named_once_a_stall(caplog):
    """One warning a stall, naming the request that held the loop; the next stalls within
    ``quiet_s`` are counted in the warning after it; a stall past ``long_s`` is warned about while
    it lasts (issue 49 item 7: 124 warnings in a 30-minute run, each logged twice)."""
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, interval_s=0.02, warn_s=0.1, quiet_s=1.5, long_s=0.5)

    async def holder(seconds: float) -> None:
        monitor.name_current_task("POST /predictions/{model_name}")
        await asyncio.sleep(0.1)  # let a few heartbeats pass first
        time.sleep(seconds)  # holds the loop: the scenario under test

    async def main() -> None:
        monitor.start()
        try:
            for seconds in (0.3, 0.2, 0.2, 1.0):  # the 2nd and 3rd end within quiet_s of the 1st
                await asyncio.create_task(holder(seconds))
            await asyncio.sleep(0.1)
        finally:
            monitor.stop()

    with caplog.at_level(logging.WARNING, "inference_service.loop_lag"):
        asyncio.run(main())
    messages = [r.getMessage() for r in caplog.records]
    ended = [m for m in messages if m.startswith("the event loop ran")]
    assert len(ended) == 2, messages
    assert ended[0].endswith("ms late, held by POST /predictions/{model_name}"), ended
    assert "held by POST /predictions/{model_name}; 2 more since the last warning, the longest" in ended[1], ended
    assert [m for m in messages if "so far by POST /predictions/{model_name}" in m], messages  # the 1 s one
    count = registry.get_sample_value(f"{METRIC}_count")
    slow = count - registry.get_sample_value(f"{METRIC}_bucket", {"le": "0.1"})
    assert count >= 5 and slow == 4, (count, slow)


NUMBERS = st.lists(st.one_of(st.integers(-10**20, 10**20), st.floats(allow_nan=False)), max_size=3000)


@settings(max_examples=60, deadline=None)
@given(numbers=NUMBERS, text=st.text(max_size=30), nested=st.booleans(), rows=st.integers(1, 4))
def test_loads_sliced_is_json_loads(numbers, text, nested, rows):
    # the numbers also inside a string (no backslash in it: the sliced path must skip it)
    doc = {"t": text, "data": [numbers] * rows if nested else numbers, "s": json.dumps(numbers), "n": [[], {}]}
    body = json.dumps(doc).encode() + b" " * OFFLOAD_BYTES  # large enough for the sliced path
    assert loads_sliced(body) == json.loads(body)


@pytest.mark.parametrize("body", [
    b"[" + b"1," * 40_000 + b"]",  # a trailing comma
    b"[" + b"1," * 40_000 + b",2]",  # an empty element
    b"[" + b"01," * 40_000 + b"2]",  # a leading zero
    b'{"a": [' + b"1," * 40_000 + b"2]",  # not closed
    b"[" + b"1-," * 40_000 + b"2]",
])
def test_loads_sliced_refuses_what_json_loads_refuses(body):
    with pytest.raises(ValueError):
        json.loads(body)
    with pytest.raises(ValueError):
        loads_sliced(body + b" " * OFFLOAD_BYTES)


def test_the_bounds_are_config_properties_keys():
    settings = Settings()
    assert (settings.max_request_parts, settings.max_json_depth, settings.max_engine_requests) == (1000, 64, 64)
    apply_properties(settings, {"max_request_parts": "5", "max_json_depth": " 8 ", "max_engine_requests": "128"},
                     "config.properties")
    assert (settings.max_request_parts, settings.max_json_depth, settings.max_engine_requests) == (5, 8, 128)
    for key in ("max_request_parts", "max_json_depth", "max_engine_requests"):
        with pytest.raises(ConfigError, match=key):
            apply_properties(Settings(), {key: "0"}, "config.properties")


def _bytes_tensor(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def test_raw_bytes_stay_raw_and_slice_in_any_order():
    values = [f"v{i}".encode() * (i % 5) for i in range(3 * JSON_SLICE + 7)]
    raw = _bytes_tensor(values)
    data = raw_elements(DATATYPES["BYTES"], raw, len(values), "x", InvalidArgument)
    assert isinstance(data, RawBytesElements) and data.raw is raw and len(data) == len(values)
    assert data[5:9] == values[5:9] and data[9:12] == values[9:12] and data[0:3] == values[0:3]  # back again
    assert data == values and list(data) == values
    request = InferRequest("m", "", "", [make_input("s", "BYTES", [len(values)], data, typed=True)])
    body = json.loads(request.handler_body())
    assert body["inputs"][0]["data"] == [base64.b64encode(v).decode() for v in values]


@pytest.mark.parametrize("raw, count, needle", [
    (b"\x01\x00", 1, "ends inside an element's 4-byte length"),
    (struct.pack("<I", 9) + b"abc", 1, "claims 9 bytes, 3 remain"),
    (_bytes_tensor([b"a", b"b"]), 3, "holds 2 elements, the shape 3"),
])
def test_raw_bytes_that_do_not_hold_the_shape_are_invalid_argument(raw, count, needle):
    with pytest.raises(InvalidArgument, match=needle):
        raw_elements(DATATYPES["BYTES"], raw, count, "input 's'", InvalidArgument)


@pytest.mark.parametrize("name", ["FP32", "BF16", "INT16"])
def test_encode_raw_across_slices_is_one_struct_pack(name):
    from inference_service.frontends.oip.tensors import PACK_SLICE, decode_raw, encode_raw

    dtype = DATATYPES[name]
    count = 2 * PACK_SLICE + 3
    values = [float(i % 251) if dtype.kind == "float" else i % 251 for i in range(count)]
    raw = encode_raw(dtype, values, "o", InvalidArgument)
    assert len(raw) == count * dtype.itemsize
    assert decode_raw(dtype, raw, count, "o", InvalidArgument) == values
