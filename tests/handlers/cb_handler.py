"""A TorchServe-style continuous-batching handler (``continuousBatching: true``), written the way
TorchServe's own streaming test handler is: per-request state in ``context.cache``, one step per
call, ``context.stopping_criteria`` set in ``postprocess``.

Body (JSON): ``steps`` (messages to send, the last one final), ``delay`` (s per call),
``log`` (optional file: one line per dropped request), ``reject`` (answer status 400),
``single`` (stopping criterion returns None: one non-streamed answer).
Each message is JSON: ``{"step": i, "batch": requests in this call, "max_batch": most seen}``.
"""
import json
import time

from ts.torch_handler.base_handler import BaseHandler


class ContinuousSteps(BaseHandler):
    def initialize(self, ctx):
        self.context = ctx
        ctx.cache = {}
        self.max_batch = 0
        self.initialized = True

    def preprocess(self, data):
        ids = list(self.context.request_ids.values())
        self.max_batch = max(self.max_batch, len(ids))
        for idx, (req_id, row) in enumerate(zip(ids, data, strict=True)):
            if req_id not in self.context.cache:
                body = _json(row.get("data") or row.get("body"))
                self.context.cache[req_id] = {"steps": int(body["steps"]), "done": 0, "body": body}
                if body.get("reject"):
                    self.context.set_response_status(400, "rejected as asked", idx)
            else:
                assert row == {}, "a running request is sent again without its inputs"
        return ids

    def inference(self, ids):
        time.sleep(max(float(self.context.cache[i]["body"].get("delay", 0)) for i in ids))
        out = []
        for req_id in ids:
            state = self.context.cache[req_id]
            out.append({"step": state["done"], "batch": len(ids), "max_batch": self.max_batch})
            state["done"] += 1
        return out

    def postprocess(self, results):
        self.context.stopping_criteria = [self._criterion(i) for i in self.context.request_ids.values()]
        return [json.dumps(r) for r in results]

    def _criterion(self, req_id):
        def stop(_result):
            state = self.context.cache[req_id]
            if state["body"].get("single"):
                del self.context.cache[req_id]
                return None
            if state["done"] >= state["steps"]:
                del self.context.cache[req_id]
                return True
            return False

        return stop

    def drop_requests(self, request_ids):
        for req_id in request_ids:
            state = self.context.cache.pop(req_id, None)
            if state is not None and state["body"].get("log"):
                with open(state["body"]["log"], "a") as f:
                    f.write(f"dropped {req_id} after {state['done']}\n")


def _json(body):
    """The request object: TorchServe hands an application/json HTTP body over decoded, gRPC's as bytes."""
    return json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
