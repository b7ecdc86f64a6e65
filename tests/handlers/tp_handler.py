"""A 2-rank tensor-parallel handler: each rank holds half of the weight's rows; an
all-reduce over gloo sums the partial products. Rank 0 streams one message per step
(send_intermediate_predict_response is a no-op on the other ranks)."""
import json
import os

import torch
import torch.distributed as dist
from ts.handler_utils.utils import send_intermediate_predict_response


class TensorParallelMatmul:
    def initialize(self, context):
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        weight = torch.randn(8, 6)  # the same full weight on every rank, then sliced
        rows = weight.shape[0] // self.world
        self.rows = slice(self.rank * rows, (self.rank + 1) * rows)
        self.weight = weight[self.rows]

    def handle(self, data, context):
        req = _json(data[0].get("data") or data[0].get("body"))
        x = torch.tensor(req["x"], dtype=torch.float32)
        for step in range(int(req["steps"])):
            partial = (x * (step + 1))[:, self.rows] @ self.weight
            dist.all_reduce(partial)
            send_intermediate_predict_response([{"step": step, "y": partial.tolist()}], context.request_ids,
                                               "ok", 200, context)
        ranks = [None] * self.world
        dist.all_gather_object(ranks, {"rank": self.rank, "pid": os.getpid(),
                                       "local_rank": os.environ["LOCAL_RANK"],
                                       "master_addr": os.environ["MASTER_ADDR"],
                                       "omp": os.environ.get("OMP_NUM_THREADS")})
        return [{"world_size": self.world, "ranks": ranks}]


def _json(body):
    """The request object: TorchServe hands an application/json HTTP body over decoded, gRPC's as bytes."""
    return json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
