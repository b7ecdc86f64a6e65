"""Generator-form handler counting its steps in a log file (see steps_handler.py)."""
import json
import os
import time


class GenSteps:
    def handle(self, data, context):
        req = _json(data[0].get("data") or data[0].get("body"))
        for i in range(int(req["steps"])):
            with open(req["log"], "a") as f:
                f.write(f"{i}\n")
            yield [f"step{i}"]
            time.sleep(float(req["delay"]))
        return [str(os.getpid())]


def _json(body):
    """The request object: TorchServe hands an application/json HTTP body over decoded, gRPC's as bytes."""
    return json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
