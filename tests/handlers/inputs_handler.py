"""Answers what the handler was handed, per input: its Python type, its value (bytes as latin-1
text) and the ``{"content-type": ...}`` request header TorchServe 0.12 gives every input."""


def handle(data, context):
    if data is None:
        return None
    return [{"inputs": {name: [type(value).__name__, _shown(value)] for name, value in row.items()},
             "headers": {name: context.get_request_header(idx, name) for name in row}}
            for idx, row in enumerate(data)]


def _shown(value):
    return bytes(value).decode("latin-1") if isinstance(value, (bytes, bytearray)) else value
