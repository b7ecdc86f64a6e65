"""Anthropic's Messages API over the same core as the OpenAI door: ``POST /v1/messages`` (whole or
streamed) and ``POST /v1/messages/count_tokens``. A request is parsed and refused as the ``/v1``
requests are (the OpenAI door's parser, then Anthropic's error shape), translated into the typed
LLM request (:mod:`.translate`) and run by :meth:`InferenceCore.stream`; the engines see nothing
new. Errors: ``{"type": "error", "error": {"type", "message"}}`` with the status of the same
failure on ``/v1`` (503 and 504 typed ``overloaded_error`` and ``timeout_error``); after a stream
started, an ``error`` event. See docs/llm.md, "Anthropic's Messages API".
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncGenerator, Awaitable, Callable

from aiohttp import web

from inference_service.contracts.request_error import InvalidRequest
from inference_service.contracts.tokenizer import TokenizeRequest
from inference_service.errors import InferenceError
from inference_service.frontends.anthropic.answers import MessageAnswer, error_body, sse
from inference_service.frontends.anthropic.schemas import CountTokensRequest, MessagesRequest
from inference_service.frontends.anthropic.translate import anthropic_field, generation_request
from inference_service.frontends.limits import off_loop
from inference_service.frontends.openai.api import IGNORED_HEADERS, OpenAIApi, OpenAIError
from inference_service.frontends.openai.format import Outcome, final_outcome, piece_of
from inference_service.frontends.request_ids import ACCESS_MODEL, handler_headers, request_id

log = logging.getLogger("inference_service.anthropic")

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
#: A refusal of the LLM handler that names its field first (as the OpenAI door reads it).
_NAMED_FIELD = re.compile(r"'([A-Za-z_][\w.\[\]]*)'[ :]")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An Anthropic error answer with ``status``."""
    return web.Response(text=json.dumps(error_body(status, message)), status=status, headers=headers,
                        content_type="application/json")


def unauthorized_response(request: web.Request) -> web.Response:
    """401 ``authentication_error`` for a request without the inference key (``x-api-key`` or Bearer)."""
    given = "x-api-key" in request.headers or "Authorization" in request.headers
    return error_response(401, "invalid x-api-key" if given else
                          "no API key: send the inference key (key_file.json) as 'x-api-key' or "
                          "'Authorization: Bearer'")


def _refusal(exc: OpenAIError) -> web.Response:
    """The Anthropic answer of a failure the OpenAI door shaped (its ``param`` named in the message)."""
    message = exc.message
    param = anthropic_field(exc.param)
    if param and param not in message:
        message = f"{param}: {message}"
    return error_response(exc.status, message, exc.headers)


class MessagesApi:
    """The two routes, over the OpenAI door's parsing, model lookup and error statuses."""

    def __init__(self, openai_api: OpenAIApi) -> None:
        self.api = openai_api
        self.core = openai_api.core

    async def answer(self, request: web.Request, route: Handler) -> web.StreamResponse:
        """Run ``route``, every failure answered in Anthropic's error shape."""
        try:
            return await route(request)
        except OpenAIError as exc:
            return _refusal(exc)
        except InferenceError as exc:
            return _refusal(self.api.error_of(exc))
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body exceeds max_request_size={request.client_max_size} bytes")
        except ConnectionResetError:
            log.info("HTTP %s %s: the connection closed before the whole request body arrived",
                     request.method, request.path)
            return error_response(400, "the connection closed before the whole request body arrived")
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return error_response(500, "Internal server error")

    def _model(self, request: web.Request, model: str) -> tuple[str, str]:
        """``(name, version)`` of an LLM model; 404 unknown, 400 a model that takes no LLM request."""
        request[ACCESS_MODEL] = model
        name, version = self.api._resolve(model)
        if model not in self.api._ids():
            raise OpenAIError(400, f"the model `{model}` is not an LLM: {request.path} needs one", param="model")
        return name, version

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages``."""
        body = await self.api._parse(request, MessagesRequest)
        name, version = self._model(request, body.model)
        constrained = body.tool_choice is not None and body.tool_choice.type in ("any", "tool")
        try:
            generation, plan = await off_loop(generation_request, body, size=request.content_length or 0)
        except InvalidRequest as exc:
            raise OpenAIError(400, str(exc), param=anthropic_field(exc.field, constrained)) from None
        headers = handler_headers(request.headers.items(), request.get("request_id") or request_id(None))
        answer = MessageAnswer(body.model, plan)
        stream = self.core.stream(name, version, {"body": generation.to_body()}, headers)
        async with contextlib.aclosing(stream):
            try:
                first = await anext(stream)  # a failure before it is an error status
            except InferenceError as exc:  # the handler's 400 names the LLM's field first
                error = self.api.error_of(exc)
                named = _NAMED_FIELD.match(exc.message) if exc.http_status == 400 else None
                error.param = anthropic_field(named[1], constrained) if named else error.param
                raise error from None
            if body.stream:
                return await self._stream(request, first, stream, answer)
            async for payload, final in _chain(first, stream):
                _add(answer, payload, final)
        return web.json_response(answer.message(), headers=request.get(IGNORED_HEADERS),
                                 dumps=lambda obj: json.dumps(obj, ensure_ascii=False))

    async def _stream(self, request: web.Request, first: tuple[bytes, bool],
                      stream: AsyncGenerator[tuple[bytes, bool], None], answer: MessageAnswer) -> web.StreamResponse:
        response = web.StreamResponse(headers={**_SSE_HEADERS, **(request.get(IGNORED_HEADERS) or {})})
        try:
            await response.prepare(request)
            events = answer.start()
            async for payload, final in _chain(first, stream):
                _add(answer, payload, final)
                events += answer.take()
                if events:
                    await response.write(b"".join(sse(event) for event in events))
                    events = []
            await response.write_eof()
        except InferenceError as exc:  # the status line is gone: end with an error event
            log.warning("HTTP stream of %s failed after its first event: %s", request.path, exc.message)
            with contextlib.suppress(ConnectionResetError):
                await response.write(sse(error_body(self.api.error_of(exc).status, exc.message)))
                await response.write_eof()
        except ConnectionResetError:  # the client went away; closing the stream aborts the request
            log.info("client of HTTP %s went away mid-stream", request.path)
        return response

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens"}``, the prompt tokens the same
        request's generation counts (the model's chat template with the tools, its tokenizer)."""
        body = await self.api._parse(request, CountTokensRequest)
        name, version = self._model(request, body.model)
        try:
            generation, _ = await off_loop(generation_request, body, size=request.content_length or 0)
            asked = TokenizeRequest.build({"messages": list(generation.messages or ()),
                                           "tools": list(generation.tools) or None})
        except InvalidRequest as exc:
            raise OpenAIError(400, str(exc), param=anthropic_field(exc.field)) from None
        headers = handler_headers(request.headers.items(), request.get("request_id") or request_id(None))
        payload = await self.core.predict(name, version, {"body": asked.to_body()}, headers)
        return web.json_response({"input_tokens": int(json.loads(payload)["count"])},
                                 headers=request.get(IGNORED_HEADERS))


async def _chain(first: tuple[bytes, bool],
                 rest: AsyncGenerator[tuple[bytes, bool], None]) -> AsyncGenerator[tuple[bytes, bool], None]:
    yield first
    if not first[1]:
        async for item in rest:
            yield item


def _add(answer: MessageAnswer, payload: bytes, final: bool) -> None:
    """One message of the handler into the answer."""
    if final:
        outcome: Outcome = final_outcome(payload)
        answer.end(outcome)
    else:
        answer.feed(piece_of(payload, False).text)
