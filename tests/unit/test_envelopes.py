"""TorchServe's request envelopes (``ts.torch_handler.request_envelope.*``): what the wrapped handler
gets and what each request gets back, for batches of one and of several requests."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import inference_service
from inference_service.handler.envelopes import (
    BodyEnvelope,
    JSONEnvelope,
    KServeEnvelope,
    KServev2Envelope,
    envelope_class,
    wrap,
)


class FakeContext(SimpleNamespace):
    """The bits of a worker's Context the envelopes read."""

    def __init__(self, headers: dict[int, dict[str, str]] | None = None) -> None:
        super().__init__(manifest={"model": {"modelName": "m", "modelVersion": "2.0"}})
        self.headers = headers or {}

    def get_request_id(self, idx: int = 0) -> str:
        return f"req-{idx}"

    def get_request_header(self, idx: int, key: str) -> str | None:
        return self.headers.get(idx, {}).get(key)


def recorder(results: Any) -> tuple[list[Any], Any]:
    seen: list[Any] = []

    def handle(data: Any, context: Any) -> Any:
        seen.append(data)
        return results(data) if callable(results) else results

    return seen, handle


def test_load_call_passes_through():
    seen, handle = recorder(None)
    assert KServev2Envelope(handle).handle(None, FakeContext()) is None
    assert seen == [None]


def test_body():
    seen, handle = recorder(lambda data: [len(d) for d in data])
    out = BodyEnvelope(handle).handle([{"body": b"abc"}, {"data": b"x"}], FakeContext())
    assert seen == [[b"abc", b"x"]] and out == [3, 1]


def test_json_tf_serving_format_per_request():
    seen, handle = recorder(lambda data: [f"p{i}" for i in range(len(data))])
    rows = [{"body": json.dumps({"instances": [{"b64": "aGk="}, {"img": {"b64": "eA=="}, "k": 1}]}).encode()},
            {"body": {"instances": [3]}}]
    out = JSONEnvelope(handle).handle(rows, FakeContext())
    assert seen == [[b"hi", {"img": b"x", "k": 1}, 3]]
    assert [json.loads(o) for o in out] == [{"predictions": ["p0", "p1"]}, {"predictions": ["p2"]}]


def test_kserve_v1_predictions_and_explanations():
    seen, handle = recorder(lambda data: [x * 2 for x in data])
    rows = [{"body": b'{"instances": [1, 2]}'}, {"body": b'{"instances": [5]}'}]
    out = KServeEnvelope(handle).handle(rows, FakeContext({1: {"explain": "True"}}))
    assert seen == [[1, 2, 5]]
    assert out == [{"predictions": [2, 4]}, {"explanations": [10]}]


def test_kservev2_inputs_reshaped_and_outputs_named_after_inputs():
    seen, handle = recorder(lambda data: [torch.tensor(d["data"], dtype=torch.float32) * 2 if d["datatype"] == "FP32"
                                          else d["data"].upper() if d["datatype"] == "BYTES" else [1.5, 2.5]
                                          for d in data])
    first = {"id": "abc", "model_name": "m", "inputs": [
        {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]},
        {"name": "s", "shape": [1], "datatype": "BYTES", "data": ["hello", "ignored"]}]}
    second = {"id": "", "inputs": [{"name": "i", "shape": [2], "datatype": "INT64", "data": [7, 8]}]}
    context = FakeContext()
    out = KServev2Envelope(handle).handle([{"body": json.dumps(first).encode()}, {"body": second}], context)
    assert [d["data"] for d in seen[0]] == [[[1, 2], [3, 4]], "hello", [7, 8]]  # reshaped; BYTES: first element
    assert context.input_names == ["x", "s", "i"]
    assert out == [
        {"id": "abc", "model_name": "m", "model_version": "2.0", "outputs": [
            {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [2.0, 4.0, 6.0, 8.0]},
            {"name": "s", "datatype": "BYTES", "shape": [1], "data": ["HELLO"]}]},  # one scalar: [1], as TorchServe
        {"id": "req-1", "model_name": "m", "model_version": "2.0", "outputs": [
            {"name": "i", "datatype": "FP64", "shape": [2], "data": [1.5, 2.5]}]},
    ]


def test_kservev2_result_count_must_match():
    _, handle = recorder([1])
    body = {"inputs": [{"name": "a", "shape": [1], "datatype": "INT64", "data": [1]},
                       {"name": "b", "shape": [1], "datatype": "INT64", "data": [2]}]}
    with pytest.raises(ValueError, match="returned 1 results for 2 items"):
        KServev2Envelope(handle).handle([{"body": body}], FakeContext())
    with pytest.raises(ValueError, match='no "inputs" list'):
        KServev2Envelope(handle).handle([{"body": b"{}"}], FakeContext())


def test_names_and_compat_import_paths(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(inference_service.__file__).parent / "compat"))  # as workers do
    from ts.torch_handler.request_envelope.base import BaseEnvelope
    from ts.torch_handler.request_envelope.kservev2 import KServev2Envelope as Compat

    assert Compat is KServev2Envelope and issubclass(Compat, BaseEnvelope)
    assert envelope_class("kservev2") is KServev2Envelope and envelope_class("body") is BodyEnvelope
    with pytest.raises(ValueError, match="unknown service_envelope 'soap'"):
        envelope_class("soap")
    seen, handle = recorder(lambda data: data)
    assert wrap(handle, "body")([{"data": b"z"}], FakeContext()) == [b"z"]
