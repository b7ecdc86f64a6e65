"""One embedding request, typed: OpenAI's ``/v1/embeddings`` body, which is also what TorchServe's
``/predictions`` and gRPC ``Predictions`` send the embedding handler (docs/embeddings.md).

Built by the OpenAI door (to refuse a bad body before it reaches a worker) and by the handler.
Every problem raises :class:`InvalidEmbeddingRequest` (400) naming the field in OpenAI's style
(``input``, ``input[3]``, ``encoding_format``, ``dimensions``); the handler's own refusals (an
input longer than the model takes) carry the same ``"<field>: <message>"`` text, which
:func:`refused_field` reads back for OpenAI's ``param``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inference_service.contracts.request_error import FieldRefusal
from inference_service.contracts.request_error import refused_field as _refused_field

#: Most inputs one request may hold (OpenAI's limit).
MAX_INPUTS = 2048
#: ``encoding_format`` values: a list of floats, or the float32 little-endian bytes in base64 (OpenAI's).
ENCODING_FORMATS = ("float", "base64")
#: The fields the handler reads; others (``user``, ...) are ignored, as OpenAI's clients send them.
REQUEST_FIELDS = ("input", "model", "encoding_format", "dimensions")

_FIELD = re.compile(r"(input(?:\[\d+\]){0,2}|encoding_format|dimensions|model): ")


class InvalidEmbeddingRequest(FieldRefusal):
    """A bad embedding request; ``field`` is the request field at fault (``input[3]``), ``status``
    the HTTP status to answer (400; 413 for an answer that would pass ``max_response_size``)."""


def refused_field(message: str) -> str | None:
    """The field a refusal's message names (``"input[3]: ..."`` -> ``input[3]``), else ``None``."""
    return _refused_field(_FIELD, message)


#: One input: a text, or token ids of the model's tokenizer.
Input = str | list[int]


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """``inputs``: texts or token-id lists, in the request's order; ``model``: the body's
    ``model`` (echoed in the answer) or ``None``; ``dimensions``: ``None`` for the model's own;
    ``bare``: ``input`` was one string or one token-id list, not a list of inputs."""

    inputs: list[Input]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    bare: bool = True

    def fields(self) -> list[str]:
        """Each input's field name in errors: ``input`` when bare, else ``input[i]``."""
        return ["input"] if self.bare else [f"input[{i}]" for i in range(len(self.inputs))]

    @classmethod
    def build(cls, body: Mapping[str, Any]) -> EmbeddingRequest:
        """The request of a decoded JSON object.

        Raises:
            InvalidEmbeddingRequest: no ``input``, an empty one, more than :data:`MAX_INPUTS`
                inputs, an input that is not a non-empty string or list of token ids (integers
                from 0), a mixed list, an unknown ``encoding_format``, a ``dimensions`` that is
                not a positive integer, a ``model`` that is not a string.
        """
        if "input" not in body:
            raise InvalidEmbeddingRequest("input", "is required: a string, a list of strings, or token ids")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidEmbeddingRequest("model", f"must be a string, got {_kind(model)}")
        encoding = body.get("encoding_format")
        if encoding is None:
            encoding = "float"
        if encoding not in ENCODING_FORMATS:
            raise InvalidEmbeddingRequest("encoding_format", f"must be 'float' or 'base64', got {_shown(encoding)}")
        dimensions = body.get("dimensions")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or dimensions < 1):
            raise InvalidEmbeddingRequest("dimensions", f"must be a positive integer, got {_shown(dimensions)}")
        value = body["input"]
        bare = isinstance(value, str) or (isinstance(value, list) and bool(value) and _is_token(value[0]))
        return cls(parse_inputs(value), model, encoding, dimensions, bare)


def parse_inputs(value: Any) -> list[Input]:
    """OpenAI's ``input``: a string, a list of strings, a list of token ids, or a list of lists of
    token ids; as a list of inputs. InvalidEmbeddingRequest naming the input at fault."""
    if isinstance(value, str):
        return [_text(value, "input")]
    if not isinstance(value, list):
        raise InvalidEmbeddingRequest("input", f"must be a string or a list, got {_kind(value)}")
    if not value:
        raise InvalidEmbeddingRequest("input", "is an empty list; send at least one input")
    if len(value) > MAX_INPUTS:
        raise InvalidEmbeddingRequest("input", f"holds {len(value)} inputs, more than {MAX_INPUTS}")
    first = value[0]
    if _is_token(first):  # one input of token ids
        return [_token_ids(value, "input")]
    if isinstance(first, list):
        out: list[Input] = []
        for index, item in enumerate(value):
            if not isinstance(item, list):
                raise InvalidEmbeddingRequest(f"input[{index}]", f"must be a list of token ids like input[0], "
                                                                 f"got {_kind(item)}")
            out.append(_token_ids(item, f"input[{index}]"))
        return out
    texts: list[Input] = []
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidEmbeddingRequest(f"input[{index}]", f"must be a string like input[0], got {_kind(item)}")
        texts.append(_text(item, f"input[{index}]"))
    return texts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: str, field: str) -> str:
    if not value:
        raise InvalidEmbeddingRequest(field, "is an empty string")
    return value


def _token_ids(ids: list[Any], field: str) -> list[int]:
    if not ids:
        raise InvalidEmbeddingRequest(field, "is an empty list of token ids")
    for index, token in enumerate(ids):
        if not _is_token(token) or token < 0:
            raise InvalidEmbeddingRequest(f"{field}[{index}]", f"must be a token id (an integer from 0), "
                                                               f"got {_shown(token)}")
    return ids


def parse_body(body: Any) -> EmbeddingRequest:
    """The request of a handler's body: bytes as UTF-8, ``str``, or a decoded ``dict``. A JSON object
    is :meth:`EmbeddingRequest.build`; any other text is one input, as is.

    Raises:
        InvalidEmbeddingRequest: invalid UTF-8, an empty body, a ``{`` body that is not JSON, a
            field :meth:`EmbeddingRequest.build` refuses.
    """
    if isinstance(body, Mapping):
        return EmbeddingRequest.build(body)
    if isinstance(body, (bytes, bytearray, memoryview)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidEmbeddingRequest("input", f"the request body is not UTF-8 text ({exc.reason} at byte "
                                                   f"{exc.start})") from None
    if not isinstance(body, str):
        raise InvalidEmbeddingRequest("input", f"the request body must be text or a JSON object, got {_kind(body)}")
    if body.lstrip().startswith("{"):
        try:
            obj = json.loads(body)
        except ValueError as exc:
            raise InvalidEmbeddingRequest("input", f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidEmbeddingRequest("input", "the request body nests JSON too deep") from None
        if isinstance(obj, dict):
            return EmbeddingRequest.build(obj)
    if not body:
        raise InvalidEmbeddingRequest("input", "the request body is empty; send a text or a JSON object")
    return EmbeddingRequest([body])


def _kind(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."
