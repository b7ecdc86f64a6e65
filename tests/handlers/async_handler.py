"""An ``asyncCommunication: true`` handler written like TorchServe's vLLM handler: ``async def
handle`` on a batch of one, intermediate messages through ``send_intermediate_predict_response``.

Body (JSON): ``parts`` (intermediate messages), ``delay`` (s awaited before each), ``log``
(optional file: a line when the request is cancelled), ``status`` (optional: set this HTTP
status with the phrase "handler says no" and return). The final message is JSON
``{"concurrent": requests running when this one started, "max": most running at once}``.
"""
import asyncio
import json

from ts.handler_utils.utils import send_intermediate_predict_response
from ts.torch_handler.base_handler import BaseHandler


class AsyncParts(BaseHandler):
    def initialize(self, ctx):
        self.running = 0
        self.max_running = 0
        self.initialized = True

    async def handle(self, data, context):
        assert len(data) == 1, "async handlers get one request per call"
        body = _json(data[0].get("data") or data[0].get("body"))
        if "status" in body:
            context.set_response_status(int(body["status"]), "handler says no", 0)
            return ["refused"]
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        seen = self.running
        try:
            for i in range(int(body.get("parts", 0))):
                await asyncio.sleep(float(body.get("delay", 0)))
                send_intermediate_predict_response([f"part{i}"], context.request_ids, "Result", 200, context)
            await asyncio.sleep(float(body.get("delay", 0)))
            return [json.dumps({"concurrent": seen, "max": self.max_running})]
        except asyncio.CancelledError:
            if body.get("log"):
                with open(body["log"], "a") as f:
                    f.write(f"cancelled {context.request_ids[0]}\n")
            raise
        finally:
            self.running -= 1


def _json(body):
    """The request object: TorchServe hands an application/json HTTP body over decoded, gRPC's as bytes."""
    return json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
