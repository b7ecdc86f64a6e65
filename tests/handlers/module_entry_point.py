"""TorchServe's documented "module level entry point" (docs/custom_service.md): a handler class
used through a module-level ``handle(data, context)``. TorchServe serves the function, not the
class; the load calls it once with ``data=None``."""

INIT_CALLS = []


class Reverser:
    """Served only through ``handle`` below (served directly it would answer ``class:``)."""

    def initialize(self, context):
        self.model_name = context.manifest["model"]["modelName"]

    def handle(self, data, context):
        return [f"class:{bytes(row.get('data') or row.get('body')).decode()}" for row in data]

    def reverse(self, text):
        return text[::-1]


_service = Reverser()


def handle(data, context):
    if data is None:
        INIT_CALLS.append(context.manifest["model"]["modelName"])
        _service.initialize(context)
        return None
    return [f"module:{len(INIT_CALLS)}:{_service.reverse(bytes(row.get('data') or row.get('body')).decode())}"
            for row in data]


def shout(data, context):
    """A second entry point, picked with ``module_entry_point:shout``."""
    if data is None:
        return None
    return [bytes(row.get("data") or row.get("body")).decode().upper() for row in data]
