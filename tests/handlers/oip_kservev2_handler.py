"""A handler written for TorchServe's ``kservev2`` request envelope: a BaseHandler over the Doubler
(y = 2x) whose ``preprocess`` gets the v2 input tensors as the envelope hands them (dicts whose
``data`` is reshaped to ``shape``) and whose results become outputs named after the inputs.

TorchServe applies the envelope named by ``service_envelope``; this module applies it itself, the
way a handler can without that setting.
"""
import torch
from ts.torch_handler.base_handler import BaseHandler
from ts.torch_handler.request_envelope.kservev2 import KServev2Envelope


class KServeV2Doubler(BaseHandler):
    def preprocess(self, data):
        self.rows = [len(tensor["data"]) for tensor in data]
        return torch.cat([torch.tensor(tensor["data"], dtype=torch.float32) for tensor in data])

    def postprocess(self, data):
        return list(data.split(self.rows))


_handler = KServeV2Doubler()
_envelope = KServev2Envelope(_handler.handle)


def handle(data, context):
    if data is None:  # the load-time call
        _handler.initialize(context)
        return None
    return _envelope.handle(data, context)
