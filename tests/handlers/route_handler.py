"""Test handler that routes on the ``url_path`` request header, as TorchServe 0.12's vLLM handler does.

Written only against TorchServe's documented API. ``url_path`` is what follows the version in
``/predictions/{model}/{version}/{rest}``. Answers, per request, the JSON object
``{"url_path": <header or null>, "body": <request body text>}`` for no path, ``""``,
``v1/models``, ``v1/completions`` and ``v1/chat/completions``; any other path fails with the
handler's 404 "Unknown API endpoint: <path>" (the vLLM handler's answer). A body containing
``sleep:S`` sleeps S seconds first (keeps the worker busy); one containing ``status:CODE``
fails with that status and the message "handler says no"; ``parts:N`` sends the intermediate
responses ``p0 ``, ``p1 ``, ... first, and then ``raise`` fails with "failed mid-stream".
It declares ``accepts_generation_requests`` (this server's addition), so that OpenAI's ``/v1/models``
lists it as it lists the bundled LLM handler.
"""
import json
import re
import time

from ts.handler_utils.utils import send_intermediate_predict_response

KNOWN = {None, "", "v1/models", "v1/completions", "v1/chat/completions"}


class RouteHandler:
    accepts_generation_requests = True

    def initialize(self, context):
        self.initialized = True

    def handle(self, data, context):
        out = []
        for idx, row in enumerate(data):
            body = _text(row.get("data") or row.get("body") or b"")
            url_path = context.get_request_header(idx, "url_path")
            pause = re.search(r"sleep:([0-9.]+)", body)
            if pause:
                time.sleep(float(pause.group(1)))
            parts = re.search(r"parts:([0-9]+)", body)
            for i in range(int(parts.group(1)) if parts else 0):
                send_intermediate_predict_response([f"p{i} "], context.request_ids, "Intermediate Prediction success",
                                                   200, context)
            if parts and "raise" in body:
                raise ValueError("failed mid-stream")
            status = re.search(r"status:([0-9]+)", body)
            if status:
                context.set_response_status(int(status.group(1)), "handler says no", idx)
                out.append("")
                continue
            if url_path not in KNOWN:
                context.set_response_status(404, f"Unknown API endpoint: {url_path}", idx)
                out.append("")
                continue
            out.append(json.dumps({"url_path": url_path, "body": body}))
        return out


def _text(body):
    """The body as text: TorchServe hands an HTTP body over as str (text/*), decoded (application/json)
    or bytes, a gRPC input as bytes."""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body).decode("utf-8", "replace")
    return body if isinstance(body, str) else json.dumps(body)
