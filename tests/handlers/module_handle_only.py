"""A handler file that is only a module-level ``handle(data, context)`` (no class at all)."""
import json

STATE = {"loads": 0}


def handle(data, context):
    if data is None:
        STATE["loads"] += 1
        return None
    return [f"only:{STATE['loads']}:{_text(row.get('data') or row.get('body'))}" for row in data]


def _text(body):
    """The body as text: TorchServe hands an HTTP body over as str (text/*), decoded (application/json)
    or bytes, a gRPC input as bytes."""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body).decode()
    return body if isinstance(body, str) else json.dumps(body)
