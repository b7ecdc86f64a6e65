"""Test handler written only against TorchServe's documented API: a module with one class.

Body commands: ``stream:N[:DELAY]`` sends N intermediate responses DELAY seconds
apart, ``pid`` answers the worker's pid, ``boom`` raises, ``sleep:S`` sleeps,
``status:CODE`` sets a response status, ``exit`` kills the worker process,
``headers`` answers the request headers as JSON, ``replyheaders:N`` sets response headers
(``Content-Type: application/x-echo``, ``X-Echo-Parts: N``, a ``Content-Length`` that must not
pass) and sends N intermediate responses, ``batch`` the batch size,
``touch:PATH`` appends a line to PATH, ``repeat:N`` answers N bytes, ``tensor``
a torch tensor, ``streamclock:N:SIZE`` sends N intermediate responses of SIZE bytes
(``<i>:`` then padding) as fast as it may and answers ``time.monotonic()`` when it has
sent them; anything else is echoed.
"""
import json
import os
import time

from ts.handler_utils.utils import send_intermediate_predict_response


class EchoHandler:
    def initialize(self, context):
        self.context = context
        self.initialized = True

    def handle(self, data, context):
        out = []
        for idx, row in enumerate(data):
            body = row.get("data") or row.get("body") or b""
            if isinstance(body, str):  # a text/* HTTP body, as TorchServe decodes it
                text = body
            elif isinstance(body, (bytes, bytearray)):
                text = bytes(body).decode("utf-8", "replace")
            else:  # an application/json HTTP body, decoded
                text = json.dumps(body)
            if text.startswith("stream:"):
                parts = text.split(":")
                delay = float(parts[2]) if len(parts) > 2 else 0.0
                for i in range(int(parts[1])):
                    send_intermediate_predict_response(
                        [f"part{i};" for _ in data], context.request_ids, "Intermediate Prediction success", 200,
                        context)
                    if delay:
                        time.sleep(delay)
                out.append("end")
            elif text.startswith("streamclock:"):
                _, count, size = text.split(":")
                for i in range(int(count)):
                    head = f"{i}:"
                    send_intermediate_predict_response(
                        [head + "x" * (int(size) - len(head)) for _ in data], context.request_ids,
                        "Intermediate Prediction success", 200, context)
                out.append(repr(time.monotonic()))
            elif text.startswith("replyheaders:"):
                parts = int(text.split(":")[1])
                context.set_response_content_type(idx, "application/x-echo")
                context.set_response_header(idx, "X-Echo-Parts", str(parts))
                context.set_response_header(idx, "Content-Length", "1")
                for i in range(parts):
                    send_intermediate_predict_response({idx: f"part{i};"}, {idx: context.request_ids[idx]},
                                                       "Intermediate Prediction success", 200, context)
                out.append("end")
            elif text == "pid":
                out.append(str(os.getpid()))
            elif text == "boom":
                raise ValueError("boom: the handler failed")
            elif text.startswith("sleep:"):
                time.sleep(float(text.split(":")[1]))
                out.append("slept")
            elif text.startswith("status:"):
                context.set_response_status(int(text.split(":")[1]), "handler says no", idx)
                out.append("")
            elif text == "exit":
                os._exit(3)
            elif text == "headers":
                out.append(context.get_all_request_header(idx))
            elif text == "batch":
                out.append(len(data))
            elif text.startswith("touch:"):
                with open(text.split(":", 1)[1], "a") as f:
                    f.write("ran\n")
                out.append("touched")
            elif text.startswith("repeat:"):
                out.append("x" * int(text.split(":")[1]))
            elif text == "tensor":
                import torch

                out.append(torch.arange(6, dtype=torch.float32).reshape(2, 3))
            else:
                out.append(text)
        return out
