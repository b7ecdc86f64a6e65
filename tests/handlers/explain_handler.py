"""A TorchServe handler that explains, written only against TorchServe's documented API: a
BaseHandler subclass over no model that overrides ``explain_handle`` (TorchServe's hook).

Each request's item is its ``data`` or ``body`` (a dict row's), or the item itself (what an
envelope hands over). A prediction answers ``{"prediction": text, "batch": n, "explain": false}``,
an explanation ``{"explanation": text, "batch": n, "explain": true, "url_path": ...}``, where
``n`` is the batch size and ``explain`` is ``self.explain``, which BaseHandler sets. A list of
numbers (a v2 tensor) answers itself doubled as a prediction, halved as an explanation.

``handler: {envelope: kserve}`` (or ``kservev2``) in model-config.yaml wraps the handler in that
TorchServe envelope, as ``service_envelope`` would for every model.
"""
import json

from ts.torch_handler.base_handler import BaseHandler
from ts.torch_handler.request_envelope.kserve import KServeEnvelope
from ts.torch_handler.request_envelope.kservev2 import KServev2Envelope

ENVELOPES = {"kserve": KServeEnvelope, "kservev2": KServev2Envelope}


class ExplainingHandler(BaseHandler):
    def initialize(self, context):
        self.context = context
        self.initialized = True

    def preprocess(self, data):
        return [_item(row) for row in data]

    def inference(self, data, *args, **kwargs):
        return data

    def postprocess(self, data):
        return [[2 * v for v in item] if _numbers(item) else
                {"prediction": item, "batch": len(data), "explain": self.explain} for item in data]

    def explain_handle(self, data_preprocess, raw_data):
        url_path = self.context.get_request_header(0, "url_path")
        return [[v / 2 for v in item] if _numbers(item) else
                {"explanation": item, "batch": len(data_preprocess), "explain": self.explain, "url_path": url_path}
                for item in data_preprocess]


def _item(row):
    value = (row.get("data") or row.get("body")) if isinstance(row, dict) else row
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return value if isinstance(value, (str, list)) else json.dumps(value)


def _numbers(item):
    return isinstance(item, list) and all(isinstance(v, (int, float)) for v in item)


_handler = ExplainingHandler()
_handle = None


def handle(data, context):
    global _handle
    if _handle is None:
        _handler.initialize(context)
        name = ((context.model_yaml_config or {}).get("handler") or {}).get("envelope")
        _handle = ENVELOPES[name](_handler.handle).handle if name else _handler.handle
    if data is None:  # the load-time call
        return None
    return _handle(data, context)
