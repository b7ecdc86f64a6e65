"""TorchServe's request envelopes: translate an orchestrator's request format for a handler and back.

An envelope wraps a handler's ``handle(data, context)``: ``parse_input`` flattens the batch,
``format_output`` splits the results back per request, as TorchServe 0.12's
``ts/torch_handler/request_envelope`` classes do; importable by TorchServe's paths and by name
through :func:`envelope_class`. Unlike TorchServe's (first request only), every request of a
batch is parsed, and ``kservev2`` reports each output's real shape and each request's own id.
See docs/open-inference-protocol.md.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from base64 import b64decode
from collections.abc import Callable
from typing import Any

#: Numpy dtype names -> Open Inference Protocol data types (TorchServe's ``kservev2`` table).
_NUMPY_TO_DATATYPE = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
    "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64",
}


def _body(row: Any) -> Any:
    """A request's ``data`` or ``body`` input, JSON decoded (a gRPC input or ``decode_input_request=false``: bytes)."""
    body = row.get("data") or row.get("body") if isinstance(row, dict) else row
    if isinstance(body, bytes | bytearray):
        return json.loads(bytes(body).decode("utf-8"))
    return body


def _split(results: list[Any], lengths: list[int]) -> list[list[Any]]:
    """``results`` cut into pieces of ``lengths``; ValueError when the handler returned another count."""
    if len(results) != sum(lengths):
        raise ValueError(f"the handler returned {len(results)} results for {sum(lengths)} items")
    out, cursor = [], 0
    for length in lengths:
        out.append(results[cursor:cursor + length])
        cursor += length
    return out


class BaseEnvelope(ABC):
    """Wraps ``handle_fn(data, context)``; subclasses define :meth:`parse_input` and :meth:`format_output`."""

    def __init__(self, handle_fn: Callable[[Any, Any], Any]) -> None:
        self._handle_fn = handle_fn
        self.context: Any = None

    def handle(self, data: Any, context: Any) -> Any:
        """TorchServe's flow: parse a non-empty batch, call the handler, format non-empty results.
        The load-time call (``data=None``) reaches the handler unchanged."""
        self.context = context
        if data:
            data = self.parse_input(data)
        results = self._handle_fn(data, context)
        if results:
            results = self.format_output(results)
        return results

    @abstractmethod
    def parse_input(self, data: list[Any]) -> list[Any]:
        """The batch of requests (input maps) as the flat list the handler gets."""

    @abstractmethod
    def format_output(self, data: list[Any]) -> list[Any]:
        """The handler's results as one answer per request of the batch."""


class BodyEnvelope(BaseEnvelope):
    """``body``: each request's ``data`` or ``body`` input; the results unchanged."""

    def parse_input(self, data: list[Any]) -> list[Any]:
        """One item per request: its ``data`` or ``body`` input."""
        return [row.get("data") or row.get("body") for row in data]

    def format_output(self, data: list[Any]) -> list[Any]:
        """The handler's results as they are."""
        return data


class JSONEnvelope(BaseEnvelope):
    """``json``: TensorFlow Serving's REST format, ``{"instances": [...]}`` -> ``{"predictions": [...]}``."""

    def __init__(self, handle_fn: Callable[[Any, Any], Any]) -> None:
        super().__init__(handle_fn)
        self._lengths: list[int] = []

    def parse_input(self, data: list[Any]) -> list[Any]:
        """Every request's instances, concatenated; a ``{"b64": "..."}`` instance or column is decoded."""
        batches = [self._instances(row) for row in data]
        self._lengths = [len(b) for b in batches]
        return [item for batch in batches for item in batch]

    @staticmethod
    def _instances(row: Any) -> list[Any]:
        body = _body(row)
        rows = list((body if isinstance(body, dict) else {}).get("instances") or [])
        for index, item in enumerate(rows):
            if isinstance(item, dict):
                if list(item) == ["b64"]:
                    rows[index] = b64decode(item["b64"])
                else:
                    for key, value in item.items():
                        if isinstance(value, dict) and list(value) == ["b64"]:
                            item[key] = b64decode(value["b64"])
        return rows

    def format_output(self, data: list[Any]) -> list[Any]:
        """One ``{"predictions": [...]}`` JSON text per request."""
        return [json.dumps({"predictions": part}) for part in _split(list(data), self._lengths)]


class KServeEnvelope(BaseEnvelope):
    """``kserve``: KServe v1, ``{"instances": [...]}`` -> ``{"predictions": [...]}`` (or ``explanations``)."""

    def __init__(self, handle_fn: Callable[[Any, Any], Any]) -> None:
        super().__init__(handle_fn)
        self._lengths: list[int] = []

    def parse_input(self, data: list[Any]) -> list[Any]:
        """Every request's ``instances``, concatenated."""
        batches = [list((_body(row) or {}).get("instances") or []) for row in data]
        self._lengths = [len(b) for b in batches]
        return [item for batch in batches for item in batch]

    def format_output(self, data: list[Any]) -> list[Any]:
        """One ``{"predictions": [...]}`` per request; ``{"explanations": [...]}`` for a request whose
        header ``explain`` is ``True`` (what TorchServe's ``:explain`` route sets)."""
        out = []
        for index, part in enumerate(_split(list(data), self._lengths)):
            explain = self.context is not None and self.context.get_request_header(index, "explain") == "True"
            out.append({"explanations" if explain else "predictions": part})
        return out


class KServev2Envelope(BaseEnvelope):
    """``kservev2``: the Open Inference Protocol's JSON body in, a v2 response per request out."""

    def __init__(self, handle_fn: Callable[[Any, Any], Any]) -> None:
        super().__init__(handle_fn)
        self._requests: list[tuple[str, list[str]]] = []  # (id, input names) per request

    def parse_input(self, data: list[Any]) -> list[Any]:
        """The input tensors of every request, concatenated (see the module docstring)."""
        import numpy as np

        self._requests = []
        items: list[Any] = []
        for row in data:
            body = _body(row)
            inputs = body.get("inputs") if isinstance(body, dict) else None
            if not isinstance(inputs, list):
                raise ValueError('kservev2 envelope: the request body has no "inputs" list')
            for tensor in inputs:
                if tensor.get("datatype") == "BYTES":
                    tensor["data"] = tensor["data"][0]
                else:
                    tensor["data"] = np.array(tensor["data"]).reshape(tuple(tensor["shape"])).tolist()
            request_id = body.get("id")
            self._requests.append((request_id if isinstance(request_id, str) else "", [t["name"] for t in inputs]))
            items.extend(inputs)
        if self.context is not None:  # TorchServe sets these for handlers that look
            self.context.input_names = [name for _, names in self._requests for name in names]
        return items

    def format_output(self, data: list[Any]) -> list[Any]:
        """One v2 response per request: ``{"id", "model_name", "model_version", "outputs"}``."""
        manifest_model = (getattr(self.context, "manifest", None) or {}).get("model") or {}
        answers = []
        parts = _split(list(data), [len(names) for _, names in self._requests])
        for index, ((request_id, names), part) in enumerate(zip(self._requests, parts, strict=True)):
            if not request_id.strip() and self.context is not None:
                request_id = self.context.get_request_id(index) or ""
            answers.append({
                "id": request_id,
                "model_name": manifest_model.get("modelName"),
                "model_version": manifest_model.get("modelVersion"),
                "outputs": [self._tensor(item, name) for item, name in zip(part, names, strict=True)],
            })
        return answers

    @staticmethod
    def _tensor(item: Any, name: str) -> dict[str, Any]:
        import numpy as np

        if hasattr(item, "detach"):  # a torch tensor (on any device)
            item = item.detach().cpu().numpy()
        array = np.asarray(item)
        if array.ndim == 0:  # one scalar per request: shape [1], as TorchServe's envelope flattens it
            array = array.reshape(1)
        datatype = _NUMPY_TO_DATATYPE.get(str(array.dtype)) or "BYTES"
        values = array.flatten().tolist()
        if datatype == "BYTES":
            values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v if isinstance(v, str)
                      else json.dumps(v) for v in values]
        return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": values}


#: The envelopes by their ``service_envelope`` name.
ENVELOPES: dict[str, type[BaseEnvelope]] = {
    "body": BodyEnvelope,
    "json": JSONEnvelope,
    "kserve": KServeEnvelope,
    "kservev2": KServev2Envelope,
}


def envelope_class(name: str) -> type[BaseEnvelope]:
    """The envelope class called ``name`` (``service_envelope``); ValueError listing the known names."""
    found = ENVELOPES.get(name)
    if found is None:
        raise ValueError(f"unknown service_envelope {name!r} (one of {', '.join(sorted(ENVELOPES))})")
    return found


def wrap(handle: Callable[[Any, Any], Any], name: str) -> Callable[[Any, Any], Any]:
    """``handle`` wrapped in the envelope called ``name``, as TorchServe's model loader does; ValueError if unknown."""
    return envelope_class(name)(handle).handle
