"""``POST /v1/rerank`` (also ``/rerank`` and ``/v2/rerank``, as vLLM serves it) and ``POST
/v1/score``: the body is checked here, so a bad one is refused with its field in ``param`` before
it reaches a worker, then goes to the model's handler as it came; the rerank handler answers the
JSON itself (docs/rerank.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from inference_service.contracts.rerank import InvalidRerankRequest, RerankRequest, refused_field
from inference_service.errors import InferenceError, InvalidArgument
from inference_service.frontends.limits import off_loop, parse_json
from inference_service.frontends.request_ids import ACCESS_MODEL, handler_headers, request_id


def parse_rerank_body(raw: bytes, kind: str, max_depth: int, max_nodes: int) -> RerankRequest:
    """The request of a ``kind`` (``rerank`` or ``score``) body, which must name its ``model``.

    Raises:
        InvalidArgument: not JSON, nested deeper than ``max_depth``, more than ``max_nodes`` arrays.
        InvalidRerankRequest: not an object (``param`` ``None``), a field
            :meth:`RerankRequest.build` refuses, the other kind's body, or no ``model``.
    """
    body = parse_json(raw, max_depth, max_nodes)
    if not isinstance(body, dict):
        raise InvalidRerankRequest("", "the request body must be a JSON object")
    if kind == "rerank" and "query" not in body:
        raise InvalidRerankRequest("query", "is required: the text the documents are ranked against")
    if kind == "score" and "text_1" not in body:
        raise InvalidRerankRequest("text_1", "is required: a string or a list of strings")
    request = RerankRequest.build(body)
    if not request.model:
        raise InvalidRerankRequest("model", "is required: the name of a cross-encoder model")
    return request


async def rerank_route(api: Any, request: web.Request, kind: str, error_class: Callable[..., Any]) -> web.Response:
    """Answer one ``kind`` request through the model's handler (``api``: the ``OpenAIApi``);
    failures raise ``error_class`` (its ``OpenAIError``)."""
    OpenAIError = error_class  # noqa: N806
    raw = await request.read()
    try:
        settings = api.core.settings
        asked = await off_loop(parse_rerank_body, raw, kind, settings.max_json_depth, settings.max_json_nodes,
                               size=len(raw))
    except InvalidArgument as exc:
        raise OpenAIError(400, exc.message) from None
    except InvalidRerankRequest as exc:
        raise OpenAIError(400, str(exc) if exc.field else exc.message, param=exc.field or None) from None
    request[ACCESS_MODEL] = asked.model
    name, version = api._resolve(str(asked.model))
    headers = handler_headers(request.headers.items(), request.get("request_id") or request_id(None))
    try:
        payload = await api.core.predict(name, version, {"body": raw}, headers)
    except InferenceError as exc:  # the handler's 400 names the field: OpenAI's param
        error = api.error_of(exc)
        error.param = (refused_field(exc.message) if exc.http_status in (400, 413) else None) or error.param
        raise error from None
    return web.Response(body=payload, content_type="application/json")
