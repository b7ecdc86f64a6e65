"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``: OpenAI's multipart form
is read and checked here (a bad field is refused with its name in ``param`` before a worker
sees it), then the audio and the settings go to the speech model's handler, which decodes the
audio and answers in the asked ``response_format``; ``stream=true`` answers server-sent events.
docs/speech.md.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Protocol

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from inference_service.contracts.speech import InvalidSpeechRequest, SpeechRequest, refused_field
from inference_service.errors import InferenceError
from inference_service.frontends.openai.errors import SSE_HEADERS, OpenAIError
from inference_service.frontends.request_ids import ACCESS_MODEL, handler_headers, request_id
from inference_service.serving.core import InferenceCore

log = logging.getLogger("inference_service.openai")

#: The longest text field read (bytes): a prompt is at most 224 tokens to Whisper.
MAX_FIELD_BYTES = 64 * 1024
_CONTENT_TYPES = {"json": "application/json", "verbose_json": "application/json", "text": "text/plain",
                  "srt": "application/x-subrip", "vtt": "text/vtt"}


async def read_form(request: web.Request, max_parts: int) -> tuple[dict[str, list[str]], bytes | None]:
    """``(text fields by name, the file's bytes or None)`` of a multipart form.

    Raises:
        OpenAIError: 400 for a body that is not ``multipart/form-data`` or breaks it, or a field
            given twice (``file``), or too many parts; 413 naming ``max_request_size``.
    """
    if request.content_type != "multipart/form-data":
        raise OpenAIError(400, "the request body must be multipart/form-data with the audio in a 'file' part "
                               f"(got {request.content_type or 'no Content-Type'})")
    limit = request.client_max_size
    fields: dict[str, list[str]] = {}
    audio: bytes | None = None
    total = count = 0
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            count += 1
            if count > max_parts:
                raise OpenAIError(400, f"the form has more than max_request_parts={max_parts} parts")
            if not isinstance(part, BodyPartReader):
                raise OpenAIError(400, "nested multipart bodies are not read")
            data = bytearray()
            while chunk := await part.read_chunk():
                total += len(chunk)
                if total > limit:
                    raise OpenAIError(413, f"the request body exceeds max_request_size={limit} bytes; send a shorter "
                                           "or more compressed audio file", param="file", code="request_too_large")
                data += chunk
                if part.name != "file" and len(data) > MAX_FIELD_BYTES:
                    raise OpenAIError(400, f"the form field exceeds {MAX_FIELD_BYTES} bytes", param=part.name)
            if part.name == "file":
                if audio is not None:
                    raise OpenAIError(400, "the form has more than one 'file' part", param="file")
                audio = bytes(data)
            elif part.name:
                fields.setdefault(part.name, []).append(data.decode("utf-8", "replace"))
    except (ValueError, AssertionError, LookupError, HttpProcessingError) as exc:
        raise OpenAIError(400, f"malformed multipart body: {exc or type(exc).__name__}") from None
    return fields, audio


class Host(Protocol):
    """What the audio routes use of :class:`~inference_service.frontends.openai.api.OpenAIApi`."""

    core: InferenceCore

    def _resolve(self, model_id: str) -> tuple[str, str]: ...

    def error_of(self, exc: InferenceError) -> OpenAIError: ...


class AudioApi:
    """The two routes over the host's core, model lookup and error mapping."""

    def __init__(self, api: Host) -> None:
        self.api = api

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/audio/transcriptions``: the text in the audio's language (or ``language``)."""
        return await self._run(request, "transcribe")

    async def translations(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/audio/translations``: the audio's speech in English."""
        return await self._run(request, "translate")

    async def _run(self, request: web.Request, task: str) -> web.StreamResponse:
        fields, audio = await read_form(request, self.api.core.settings.max_request_parts)
        try:
            asked = SpeechRequest.build(task, fields)
        except InvalidSpeechRequest as exc:
            raise OpenAIError(400, str(exc), param=exc.field) from None
        request[ACCESS_MODEL] = asked.model
        name, version = self.api._resolve(asked.model)
        if audio is None:
            raise OpenAIError(400, "the form has no 'file' part: send the audio file as 'file'", param="file")
        headers = handler_headers(request.headers.items(), request.get("request_id") or request_id(None))
        inputs = {"body": asked.to_body(), "file": audio}
        if asked.stream:
            return await self._stream(request, self.api.core.stream(name, version, inputs, headers))
        try:
            payload = await self.api.core.predict(name, version, inputs, headers)
        except InferenceError as exc:
            raise self._error(exc) from None
        return web.Response(body=payload, content_type=_CONTENT_TYPES[asked.response_format],
                            charset="utf-8")

    def _error(self, exc: InferenceError) -> OpenAIError:
        """The OpenAI error of a failure: a handler's 400 or 413 names its field in ``param``."""
        error = self.api.error_of(exc)
        if exc.http_status in (400, 413):
            error.param = refused_field(exc.message) or error.param
        return error

    async def _stream(self, request: web.Request, messages: object) -> web.StreamResponse:
        """Server-sent events, each a handler message; a failure before the first is an error status."""
        async with contextlib.aclosing(messages) as stream:  # type: ignore[type-var]
            try:
                first = await anext(stream)  # type: ignore[call-overload]
            except InferenceError as exc:
                raise self._error(exc) from None
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            try:
                payload, final = first
                while True:
                    await response.write(b"data: " + payload + b"\n\n")
                    if final:
                        break
                    payload, final = await anext(stream)  # type: ignore[call-overload]
                await response.write_eof()
            except InferenceError as exc:
                log.warning("HTTP stream of %s failed after its first event: %s", request.path, exc.message)
                with contextlib.suppress(ConnectionResetError):
                    await response.write(self._error(exc).event())
                    await response.write_eof()
            except ConnectionResetError:
                log.info("client of HTTP %s went away mid-stream", request.path)
        return response

