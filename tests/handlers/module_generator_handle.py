"""This project's generator form as a module-level ``handle``: each ``yield`` is one intermediate
response per request, the ``return`` value the final one. At load it is called with
``data=None`` and run to its end."""
import json

STATE = {"loaded": False}


def handle(data, context):
    if data is None:
        STATE["loaded"] = True
        return
    words = [_text(row.get("data") or row.get("body")).split() for row in data]
    for i in range(max(len(w) for w in words)):
        yield [w[i] + " " if i < len(w) else None for w in words]
    return [f"<loaded={STATE['loaded']}>" for _ in data]


def _text(body):
    """The body as text: TorchServe hands an HTTP body over as str (text/*), decoded (application/json)
    or bytes, a gRPC input as bytes."""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body).decode()
    return body if isinstance(body, str) else json.dumps(body)
