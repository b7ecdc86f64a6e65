"""``POST /v1/embeddings``: OpenAI's body is checked here, so a bad one is refused with its field
in ``param`` before it reaches a worker, then goes to the model's handler as it came; the
embedding handler answers OpenAI's JSON itself (docs/embeddings.md).
"""

from __future__ import annotations

from inference_service.contracts.embeddings import EmbeddingRequest, InvalidEmbeddingRequest, refused_field
from inference_service.errors import InferenceError
from inference_service.frontends.limits import parse_json


class NotAnObject(ValueError):
    """The body is not a JSON object (OpenAI's 400 with no ``param``)."""


def parse_embedding_body(raw: bytes, max_depth: int, max_nodes: int) -> EmbeddingRequest:
    """The request of a ``/v1/embeddings`` body, which must name its ``model``.

    Raises:
        InvalidArgument: not JSON, nested deeper than ``max_depth``, more than ``max_nodes`` arrays.
        NotAnObject: not an object.
        InvalidEmbeddingRequest: a field :meth:`EmbeddingRequest.build` refuses, or no ``model``.
    """
    body = parse_json(raw, max_depth, max_nodes)
    if not isinstance(body, dict):
        raise NotAnObject("the request body must be a JSON object")
    request = EmbeddingRequest.build(body)
    if not request.model:
        raise InvalidEmbeddingRequest("model", "is required: the name of an embedding model")
    return request


def handler_refusal_param(exc: InferenceError) -> str | None:
    """The request field a handler's 400 or 413 names (``"input[3]: 300 tokens, ..."``), else ``None``."""
    return refused_field(exc.message) if exc.http_status in (400, 413) else None
