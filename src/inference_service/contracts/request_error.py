"""The one error of a malformed LLM request: every check of :mod:`.sampling` and :mod:`.structured`
raises it, and the doors answer it with 400 (gRPC ``INVALID_ARGUMENT``)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request (or config value) is malformed; ``field`` is the parameter at fault, if any."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
