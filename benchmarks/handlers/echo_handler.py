"""Echo handler for benchmarks/compare.py: returns each request's payload unchanged.

Written against TorchServe's handler API (a class with ``initialize``/``handle``), so the
same file is archived with torch-model-archiver 0.12.0 for TorchServe and for this project.
No compute: what is measured is the server's own cost per request.
"""


class EchoHandler:
    """Returns ``data`` (or ``body``) of every request in the batch as bytes, in order."""

    def initialize(self, context):
        """Nothing to load; kept for TorchServe's handler contract."""
        self.initialized = True

    def handle(self, data, context):
        """One response per request: the request's bytes (empty bytes when it has none)."""
        return [bytes(row.get("data") or row.get("body") or b"") for row in data]
