"""A BaseHandler subclass that overrides only preprocess/postprocess (TorchServe's documented API)."""
import json
import os

import torch
from ts.torch_handler.base_handler import BaseHandler


class DoublingHandler(BaseHandler):
    def preprocess(self, data):
        assert self.context is not None
        model_dir = self.context.system_properties["model_dir"]
        serialized = self.manifest["model"]["serializedFile"]
        assert os.path.isfile(os.path.join(model_dir, serialized))
        self.context.metrics.add_time("PreprocessTime", 1.5, None, "ms")
        values = [_json(row.get("data") or row.get("body")) for row in data]
        return torch.tensor(values, dtype=torch.float32)

    def postprocess(self, data):
        model_dir = self.context.system_properties["model_dir"]
        return [{"doubled": row.tolist(), "model_dir": os.path.isdir(model_dir)} for row in data]


def _json(body):
    """The request object: TorchServe hands an application/json HTTP body over decoded, gRPC's as bytes."""
    return json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
