"""One rerank or score request, typed: the body of ``/v1/rerank`` (Cohere's and Jina's shape, as
vLLM's and llama.cpp's servers take it) or of ``/v1/score`` (vLLM's), which is also what
TorchServe's ``/predictions`` and gRPC ``Predictions`` send the rerank handler (docs/rerank.md).

Built by the OpenAI door (to refuse a bad body before it reaches a worker) and by the handler.
A body with ``query`` is a rerank request, one with ``text_1`` a score request. Every problem
raises :class:`InvalidRerankRequest` (400) naming the field (``documents[3]``, ``top_n``); the
handler's refusals carry the same ``"<field>: <message>"`` text, which :func:`refused_field`
reads back for OpenAI's ``param``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inference_service.contracts.request_error import FieldRefusal
from inference_service.contracts.request_error import refused_field as _refused_field

#: Most documents of one rerank request, and most pairs of one score request (Cohere's limit).
MAX_DOCUMENTS = 1000
#: What a request asks for: ``rerank`` (results sorted by score) or ``score`` (scores in order).
KINDS = ("rerank", "score")

_FIELD = re.compile(r"((?:query|documents|text_1|text_2)(?:\[\d+\])?(?:\.text)?|top_n|return_documents|model): ")


class InvalidRerankRequest(FieldRefusal):
    """A bad rerank or score request; ``field`` is the request field at fault (``documents[3]``),
    ``status`` the HTTP status to answer (400; 413 for an answer that would pass ``max_response_size``)."""


def refused_field(message: str) -> str | None:
    """The field a refusal's message names (``"documents[3]: ..."`` -> ``documents[3]``), else ``None``."""
    return _refused_field(_FIELD, message)


@dataclass(frozen=True, slots=True)
class RerankRequest:
    """The pairs to score, ``(first, second)`` texts in the request's order.

    ``kind`` ``rerank``: ``pairs[i]`` is ``(query, documents[i])``, ``top_n`` the most results
    (``None``: all), ``return_documents`` whether each result holds its text. ``score``: ``pairs[i]``
    is ``(text_1[i] or text_1, text_2[i])``. ``fields[i]`` names pair ``i``'s second text in errors.
    """

    kind: str
    pairs: list[tuple[str, str]]
    fields: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True

    @classmethod
    def build(cls, body: Mapping[str, Any]) -> RerankRequest:
        """The request of a decoded JSON object: a rerank body when it has ``query``, else a score body.

        Raises:
            InvalidRerankRequest: a field missing, of the wrong type or empty; more than
                :data:`MAX_DOCUMENTS` documents or pairs; ``text_1`` and ``text_2`` lists of
                different lengths; a ``top_n`` below 0.
        """
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRerankRequest("model", f"must be a string, got {_kind(model)}")
        if "query" in body or "documents" in body:
            return cls._rerank(body, model)
        if "text_1" in body or "text_2" in body:
            return cls._score(body, model)
        raise InvalidRerankRequest("query", "is required: a rerank request has 'query' and 'documents', a score "
                                            "request 'text_1' and 'text_2'")

    @classmethod
    def _rerank(cls, body: Mapping[str, Any], model: str | None) -> RerankRequest:
        if "query" not in body:
            raise InvalidRerankRequest("query", "is required: the text the documents are ranked against")
        query = _text(body["query"], "query")
        documents = body.get("documents")
        if not isinstance(documents, list):
            raise InvalidRerankRequest("documents", "is required: a list of strings or of objects with 'text'"
                                       if documents is None else f"must be a list, got {_kind(documents)}")
        _count(documents, "documents")
        texts = []
        for index, item in enumerate(documents):
            if isinstance(item, Mapping):
                texts.append(_text(item.get("text"), f"documents[{index}].text"))
            elif isinstance(item, str):
                texts.append(_text(item, f"documents[{index}]"))
            else:
                raise InvalidRerankRequest(f"documents[{index}]", f"must be a string or an object with 'text', "
                                                                  f"got {_kind(item)}")
        top_n = body.get("top_n")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
            raise InvalidRerankRequest("top_n", f"must be an integer from 0 (0: every document), got {_shown(top_n)}")
        returned = body.get("return_documents", True)
        if returned is None:
            returned = True
        if not isinstance(returned, bool):
            raise InvalidRerankRequest("return_documents", f"must be true or false, got {_shown(returned)}")
        return cls("rerank", [(query, text) for text in texts], [f"documents[{i}]" for i in range(len(texts))],
                   model, top_n or None, returned)

    @classmethod
    def _score(cls, body: Mapping[str, Any], model: str | None) -> RerankRequest:
        firsts, first_bare = _texts(body.get("text_1"), "text_1")
        seconds, second_bare = _texts(body.get("text_2"), "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        elif len(firsts) != len(seconds):
            raise InvalidRerankRequest("text_2", f"holds {len(seconds)} texts and text_1 {len(firsts)}; send one "
                                                 "text_1 for all, or as many as text_2")
        fields = ["text_2"] if second_bare else [f"text_2[{i}]" for i in range(len(seconds))]
        return cls("score", list(zip(firsts, seconds, strict=True)), fields, model)


def _texts(value: Any, field: str) -> tuple[list[str], bool]:
    """A string or a non-empty list of strings; ``(texts, bare)``."""
    if isinstance(value, str):
        return [_text(value, field)], True
    if not isinstance(value, list):
        raise InvalidRerankRequest(field, "is required: a string or a list of strings" if value is None
                                   else f"must be a string or a list of strings, got {_kind(value)}")
    _count(value, field)
    return [_text(item, f"{field}[{index}]") for index, item in enumerate(value)], False


def _count(items: list[Any], field: str) -> None:
    if not items:
        raise InvalidRerankRequest(field, "is an empty list")
    if len(items) > MAX_DOCUMENTS:
        raise InvalidRerankRequest(field, f"holds {len(items)} texts, more than {MAX_DOCUMENTS}; split the request")


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidRerankRequest(field, f"must be a string, got {_kind(value)}")
    if not value:
        raise InvalidRerankRequest(field, "is an empty string")
    return value


def parse_body(body: Any) -> RerankRequest:
    """The request of a handler's body: bytes as UTF-8 JSON, ``str``, or a decoded ``dict``.

    Raises:
        InvalidRerankRequest: not UTF-8, not a JSON object, or a field :meth:`RerankRequest.build` refuses.
    """
    if isinstance(body, Mapping):
        return RerankRequest.build(body)
    if isinstance(body, (bytes, bytearray, memoryview)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRerankRequest("query", f"the request body is not UTF-8 text ({exc.reason} at byte "
                                                f"{exc.start})") from None
    if not isinstance(body, str):
        raise InvalidRerankRequest("query", f"the request body must be a JSON object, got {_kind(body)}")
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise InvalidRerankRequest("query", f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRerankRequest("query", "the request body nests JSON too deep") from None
    if not isinstance(obj, dict):
        raise InvalidRerankRequest("query", f"the request body must be a JSON object, got {_kind(obj)}")
    return RerankRequest.build(obj)


def _kind(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."
