"""A TorchServe handler written for the ``kservev2`` request envelope, unmodified: nothing here
applies the envelope; the server does when ``service_envelope=kservev2`` is configured, as
TorchServe does. ``preprocess`` gets the v2 input tensors as the envelope hands them (dicts
whose ``data`` holds the values) and the results become outputs named after the inputs."""
import torch
from ts.torch_handler.base_handler import BaseHandler


class KServeV2Doubler(BaseHandler):
    def preprocess(self, data):
        self.rows = [len(tensor["data"]) for tensor in data]
        return torch.cat([torch.tensor(tensor["data"], dtype=torch.float32) for tensor in data])

    def postprocess(self, data):
        return list(data.split(self.rows))
