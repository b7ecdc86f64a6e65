"""A ``module:function`` entry point: called once with data=None at load, then per batch."""
import json

STATE = {"initialized": False}


def handle(data, context):
    if data is None:
        STATE["initialized"] = True
        return None
    return [f"fn:{STATE['initialized']}:{_text(row.get('data') or row.get('body'))}" for row in data]


def _text(body):
    """The body as text: TorchServe hands an HTTP body over as str (text/*), decoded (application/json)
    or bytes, a gRPC input as bytes."""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body).decode()
    return body if isinstance(body, str) else json.dumps(body)
