"""What a ``/v1`` answer carries besides its body: OpenAI's error shape (every door of the
OpenAI-compatible API raises :class:`OpenAIError`, which the API's middleware answers), the
header naming ignored request fields, and the headers of a server-sent event stream."""

from __future__ import annotations

import re

from aiohttp import web

from inference_service.frontends.openai.format import sse_event
from inference_service.frontends.openai.schemas import ErrorBody, ErrorResponse

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
#: The answer's header naming the request fields that were ignored (unknown to this server).
IGNORED_FIELDS_HEADER = "x-ignored-fields"
#: Where a request keeps that header once its body is parsed.
IGNORED_HEADERS = "openai_ignored_headers"
#: A refusal of the LLM handler that names its field first (contracts/sampling.py's messages).
NAMED_FIELD = re.compile(r"'([A-Za-z_][\w.\[\]]*)'[ :]")


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status: ``rate_limit_error`` (429), ``server_error``
    (5xx), ``invalid_request_error`` (other 4xx, 401 included, as OpenAI answers a wrong key)."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def openai_error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                          headers: dict[str, str] | None = None) -> web.Response:
    """OpenAI's error answer: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""
    body = ErrorResponse(error=ErrorBody(message=message, type=error_type(status), param=param, code=code))
    return web.Response(text=body.model_dump_json(), status=status, headers=headers, content_type="application/json")


class OpenAIError(Exception):
    """A /v1 failure with its OpenAI error fields (``param``: the request field at fault)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> web.Response:
        """The error answer (:func:`openai_error_response`)."""
        return openai_error_response(self.status, self.message, param=self.param, code=self.code,
                                     headers=self.headers)

    def event(self) -> bytes:
        """The error as a server-sent event, for a stream whose status line is gone already."""
        body = ErrorResponse(error=ErrorBody(message=self.message, type=error_type(self.status), param=self.param,
                                             code=self.code))
        return sse_event(body)
