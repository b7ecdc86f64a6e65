"""The one error of a malformed LLM request: every check of :mod:`.sampling` and :mod:`.structured`
raises it, and the doors answer it with 400 (gRPC ``INVALID_ARGUMENT``); and the base of the
refusals of the other model families (embeddings, rerank, speech), whose message starts with the
field at fault."""

from __future__ import annotations

import re


class InvalidRequest(ValueError):
    """A request (or config value) is malformed; ``field`` is the parameter at fault, if any."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class FieldRefusal(ValueError):
    """A bad request of a non-LLM model family: ``field`` is the request field at fault, ``status``
    the HTTP status to answer (400; 413 for an answer or input over a size limit). The message is
    ``"<field>: <message>"``, which :func:`refused_field` reads back from a handler's refusal."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status


def refused_field(pattern: re.Pattern[str], message: str) -> str | None:
    """The field ``pattern`` (its group 1, matched at the start) finds in a refusal's message, else ``None``."""
    match = pattern.match(message)
    return match[1] if match else None
