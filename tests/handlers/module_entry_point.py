"""TorchServe's documented "module level entry point" (docs/custom_service.md): a handler class
used through a module-level ``handle(data, context)``. TorchServe serves the function, not the
class; the load calls it once with ``data=None``."""
import json

INIT_CALLS = []


class Reverser:
    """Served only through ``handle`` below (served directly it would answer ``class:``)."""

    def initialize(self, context):
        self.model_name = context.manifest["model"]["modelName"]

    def handle(self, data, context):
        return [f"class:{_text(row.get('data') or row.get('body'))}" for row in data]

    def reverse(self, text):
        return text[::-1]


_service = Reverser()


def handle(data, context):
    if data is None:
        INIT_CALLS.append(context.manifest["model"]["modelName"])
        _service.initialize(context)
        return None
    return [f"module:{len(INIT_CALLS)}:{_service.reverse(_text(row.get('data') or row.get('body')))}"
            for row in data]


def shout(data, context):
    """A second entry point, picked with ``module_entry_point:shout``."""
    if data is None:
        return None
    return [_text(row.get("data") or row.get("body")).upper() for row in data]


def _text(body):
    """The body as text: TorchServe hands an HTTP body over as str (text/*), decoded (application/json)
    or bytes, a gRPC input as bytes."""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body).decode()
    return body if isinstance(body, str) else json.dumps(body)
