"""An unmodified TorchServe-style streaming handler that knows nothing of cancellation.

Body (JSON): ``steps``, ``delay`` (s), ``log`` (file getting one line per step
started) and ``swallow`` (wrap each step in ``try/except Exception: continue``,
as careless handlers do). Answers its pid when it finishes.
"""
import json
import os
import time

from ts.handler_utils.utils import send_intermediate_predict_response


class Steps:
    def initialize(self, context):
        self.context = context

    def handle(self, data, context):
        req = _json(data[0].get("data") or data[0].get("body"))
        for i in range(int(req["steps"])):
            if req.get("swallow"):
                try:
                    self._step(i, req, context)
                except Exception:  # noqa: BLE001 - the point of the test
                    continue
            else:
                self._step(i, req, context)
        return [str(os.getpid())]

    def _step(self, i, req, context):
        with open(req["log"], "a") as f:
            f.write(f"{i}\n")
        send_intermediate_predict_response([f"step{i}"], context.request_ids, "ok", 200, context)
        time.sleep(float(req["delay"]))


def _json(body):
    """The request object: TorchServe hands an application/json HTTP body over decoded, gRPC's as bytes."""
    return json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
