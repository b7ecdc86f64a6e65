"""A stateful, continuous-batching handler in the manner of TorchServe's
``examples/stateful/sequence_continuous_batching`` (our own code, same contract): a running
sum per sequence, kept across the sequence's requests.

Body: an integer. The sequence's first request (header ``context.header_key_sequence_start``)
starts the sum at 0. An even number adds to the sum and answers it once (stopping criterion
``None``); an odd number adds and then streams the sum once per call (0.2 s) until 10 messages
were sent or a ``-1`` request of the same sequence cancels the stream; ``-1`` answers ``-1``; ``0``
answers the sum and ends the sequence (response header ``context.header_key_sequence_end``). A JSON
body ``{"input": n}`` is the number ``n``.
"""
import json
import time

from ts.torch_handler.base_handler import BaseHandler


class RunningSum(BaseHandler):
    def initialize(self, ctx):
        self.context = ctx
        ctx.cache = {}
        self.sums = {}
        self.initialized = True

    def preprocess(self, data):
        ctx = self.context
        values = []
        for idx, row in enumerate(data):
            seq = ctx.get_sequence_id(idx)
            req_id = ctx.get_request_id(idx)
            ctx.set_response_header(idx, ctx.header_key_sequence_id, seq)
            if req_id not in ctx.cache:
                if ctx.get_request_header(idx, ctx.header_key_sequence_start):
                    self.sums[seq] = 0
                body = row.get("data") if row.get("data") is not None else row.get("body")
                number = int(body["input"] if isinstance(body, dict) else _text(body))
                if number == 0:
                    ctx.set_response_header(idx, ctx.header_key_sequence_end, seq)
                if number == -1:
                    ctx.cache[seq + ":cancel"] = True
                    ctx.cache[req_id] = {"seq": seq, "stream": False, "left": 0}
                    values.append(-1)
                    continue
                self.sums[seq] = self.sums.get(seq, 0) + number
                ctx.cache[req_id] = {"seq": seq, "stream": number % 2 == 1, "left": 10}
            else:
                time.sleep(0.2)
            values.append(self.sums[seq])
        return values

    def inference(self, values):
        return values

    def postprocess(self, values):
        ctx = self.context
        ctx.stopping_criteria = [self._criterion(rid) for rid in ctx.request_ids.values()]
        return [str(v) for v in values]

    def _criterion(self, req_id):
        def stop(_result):
            state = self.context.cache[req_id]
            if not state["stream"]:
                del self.context.cache[req_id]
                return None
            state["left"] -= 1
            if self.context.cache.pop(state["seq"] + ":cancel", False) or state["left"] == 0:
                del self.context.cache[req_id]
                return True
            return False

        return stop


def _text(body):
    """The body as text: TorchServe hands an HTTP body over as str (text/*), decoded (application/json)
    or bytes, a gRPC input as bytes."""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body).decode()
    return body if isinstance(body, str) else json.dumps(body)
