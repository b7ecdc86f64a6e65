"""What a ``/v1/audio/transcriptions`` or ``/v1/audio/translations`` request asks of a speech
model's handler: OpenAI's form fields, checked (:meth:`SpeechRequest.build`), sent to the worker
as the ``body`` input (JSON, :meth:`SpeechRequest.to_body`) beside the audio file's bytes (the
``file`` input). docs/speech.md.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from inference_service.contracts.request_error import FieldRefusal
from inference_service.contracts.request_error import refused_field as _refused_field

TASKS = ("transcribe", "translate")
#: OpenAI's ``response_format`` values served.
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
#: OpenAI's ``timestamp_granularities[]`` values.
GRANULARITIES = ("segment", "word")
#: Form fields OpenAI's clients may send that change nothing here (``include[]`` asks for
#: log probabilities of the gpt-4o models; ``chunking_strategy`` is theirs too).
IGNORED = ("include[]", "chunking_strategy")
_FIELD = re.compile(r"(model|file|language|prompt|temperature|response_format|timestamp_granularities\[\]|stream): ")
_FIELDS = {"task", "model", "language", "prompt", "temperature", "response_format", "timestamp_granularities",
           "stream"}


class InvalidSpeechRequest(FieldRefusal):
    """A bad speech request: ``field`` is the form field at fault, ``status`` the HTTP status
    (400; 413 for audio over a size limit). The message starts ``"<field>: "``."""


def refused_field(message: str) -> str | None:
    """The field a refusal's message names (``"file: ..."`` -> ``file``), else ``None``."""
    return _refused_field(_FIELD, message)


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    """One request: ``task`` (:data:`TASKS`), ``language`` (ISO-639-1, ``None``: detected),
    ``temperature`` (0 to 1; 0 is greedy decoding), ``timestamp_granularities`` (a subset of
    :data:`GRANULARITIES`, only with ``verbose_json``)."""

    task: str
    model: str
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    response_format: str = "json"
    timestamp_granularities: tuple[str, ...] = field(default=())
    stream: bool = False

    @classmethod
    def build(cls, task: str, fields: dict[str, list[str]]) -> SpeechRequest:
        """The request of a form's text fields (each name's values in order).

        Raises:
            InvalidSpeechRequest: naming the field: missing ``model``, an unknown value, ``language``
                on a translation, timestamps without ``verbose_json``, a stream in srt/vtt/verbose_json.
        """
        def one(name: str) -> str | None:
            values = fields.get(name)
            if not values:
                return None
            if len(values) > 1:
                raise InvalidSpeechRequest(name, "is given more than once")
            return values[0]

        model = one("model")
        if not model:
            raise InvalidSpeechRequest("model", "is required: the name of a speech-to-text model")
        language = one("language") or None
        if language is not None:
            if task == "translate":
                raise InvalidSpeechRequest("language", "translations take no language: the audio's is detected "
                                                       "and the text is English")
            if not (language.isascii() and language.isalpha() and 2 <= len(language) <= 3):
                raise InvalidSpeechRequest("language", f"must be an ISO-639-1 code such as 'en', got {language[:20]!r}")
            language = language.lower()
        fmt = one("response_format") or "json"
        if fmt not in RESPONSE_FORMATS:
            raise InvalidSpeechRequest("response_format", f"must be one of {', '.join(RESPONSE_FORMATS)}, "
                                                          f"got {fmt[:40]!r}")
        raw_temperature = one("temperature")
        try:
            temperature = float(raw_temperature) if raw_temperature not in (None, "") else 0.0
        except ValueError:
            temperature = math.nan
        if not 0.0 <= temperature <= 1.0:
            raise InvalidSpeechRequest("temperature", f"must be a number from 0 to 1, got {raw_temperature!r:.40}")
        granularities = tuple(fields.get("timestamp_granularities[]", []) + fields.get("timestamp_granularities", []))
        for value in granularities:
            if value not in GRANULARITIES:
                raise InvalidSpeechRequest("timestamp_granularities[]", f"values must be 'segment' or 'word', "
                                                                        f"got {value[:40]!r}")
        if granularities and fmt != "verbose_json":
            raise InvalidSpeechRequest("timestamp_granularities[]", "needs response_format 'verbose_json'")
        stream = (one("stream") or "false").lower()
        if stream not in ("true", "false"):
            raise InvalidSpeechRequest("stream", f"must be true or false, got {stream[:20]!r}")
        if stream == "true" and fmt not in ("json", "text"):
            raise InvalidSpeechRequest("stream", f"streams text: use response_format 'json' or 'text', not {fmt!r}")
        return cls(task, model, language, one("prompt") or None, temperature, fmt, tuple(dict.fromkeys(granularities)),
                   stream == "true")

    def to_body(self) -> bytes:
        """The JSON the handler reads back with :meth:`from_body`."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_body(cls, body: Any) -> SpeechRequest:
        """The request of :meth:`to_body`'s JSON (bytes, or the worker's decoded dict).

        Raises:
            InvalidSpeechRequest: not such a body (field ``body``).
        """
        try:
            value = json.loads(bytes(body)) if isinstance(body, (bytes, bytearray)) else body
            if not isinstance(value, dict) or not set(value) <= _FIELDS or value.get("task") not in TASKS:
                raise ValueError("not a speech request")
            value["timestamp_granularities"] = tuple(value.get("timestamp_granularities") or ())
            return cls(**value)
        except (TypeError, ValueError) as exc:
            raise InvalidSpeechRequest("body", f"the request's body is not a speech request: {exc}") from None
