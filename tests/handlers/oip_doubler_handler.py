"""Open Inference Protocol test handler over a real torch model: a BaseHandler subclass that runs
the Doubler (y = 2x, a Linear layer) on the FP32 input ``INPUT0`` of shape [N, 2] and answers
``OUTPUT0`` (FP32, same shape), one v2 response per request of the batch."""
import json

import torch
from ts.torch_handler.base_handler import BaseHandler


class OipDoublerHandler(BaseHandler):
    def preprocess(self, data):
        self.requests = [json.loads(bytes(row.get("body") or row.get("data"))) for row in data]
        tensors = []
        for request in self.requests:
            (tensor,) = [t for t in request["inputs"] if t["name"] == "INPUT0"]
            tensors.append(torch.tensor(tensor["data"], dtype=torch.float32).reshape(tensor["shape"]))
        self.sizes = [len(t) for t in tensors]
        return torch.cat(tensors)

    def postprocess(self, data):
        answers = []
        for request, rows in zip(self.requests, data.split(self.sizes), strict=True):
            answers.append({"id": request["id"], "model_name": request["model_name"],
                            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": list(rows.shape),
                                         "data": rows.flatten().tolist()}]})
        return answers
