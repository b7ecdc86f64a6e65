"""Streaming handler for benchmarks/compare.py: N intermediate responses with no compute.

Uses TorchServe's ``ts.handler_utils.utils.send_intermediate_predict_response`` (TorchServe
0.12.0, and this project's ``ts`` compatibility shim), so the same file is archived with
torch-model-archiver for both servers. The request's ``data`` is the decimal message count
(default 1000); each intermediate message is 16 bytes, then the final response is ``b"done"``.
"""

from ts.handler_utils.utils import send_intermediate_predict_response

DEFAULT_MESSAGES = 1000
PAYLOAD = b"0123456789abcdef"


class StreamHandler:
    """Sends N-1 intermediate responses per request, then returns the last one (N messages)."""

    def initialize(self, context):
        """Nothing to load; kept for TorchServe's handler contract."""
        self.initialized = True

    def handle(self, data, context):
        """Stream ``int(data)`` messages (the last one is the return value) to every request of the batch."""
        counts = []
        for row in data:
            raw = row.get("data") or row.get("body") or b""
            counts.append(int(bytes(raw).decode() or DEFAULT_MESSAGES))
        # The stream model runs with batch size 1, so every row of a batch has the same count.
        for _ in range(max(counts) - 1):
            send_intermediate_predict_response([PAYLOAD] * len(data), context.request_ids, "Intermediate", 200, context)
        return [b"done" for _ in data]
