"""The bodies the embedding handler reads and the answers it writes: OpenAI's ``/v1/embeddings``
shape (also TorchServe's ``/predictions`` and gRPC ``Predictions``), and the Open Inference
Protocol's (v2) JSON body, one input tensor of texts (BYTES) or token ids (integers).

An OIP BYTES element reaches a handler as the client's JSON string, or base64 when it came as
bytes (gRPC, HTTP binary data: TorchServe's body). A tensor whose elements all decode strictly
from base64 to UTF-8 is read decoded, any other as sent (docs/embeddings.md).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from inference_service.contracts.embeddings import (
    EmbeddingRequest,
    InvalidEmbeddingRequest,
    parse_body,
    parse_inputs,
)

#: The output tensor of an OIP answer: FP32, shape ``[inputs, dimension]``.
OIP_OUTPUT = "embedding"
_INT_TYPES = frozenset({"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"})


@dataclass(frozen=True, slots=True)
class Job:
    """One request of a batch: what it asks, each input's field name in errors, and the OIP
    request's ``{"id", "model_name"}`` when it came as a v2 body (``None``: OpenAI's shape)."""

    request: EmbeddingRequest
    fields: list[str]
    oip: dict[str, Any] | None = None


def read_row(row: Any) -> Job:
    """The job of one row of the handler's batch (its ``data`` or ``body`` input).

    Raises:
        InvalidEmbeddingRequest: no body, or a body :func:`parse_body` or the OIP rules refuse.
    """
    body = row.get("data") if isinstance(row, dict) else row
    if body is None and isinstance(row, dict):
        body = row.get("body")
    if body is None:
        raise InvalidEmbeddingRequest("input", "the request has no 'data' or 'body' input")
    if isinstance(body, (bytes, bytearray)) and bytes(body[:1]) == b"{":
        try:
            decoded = json.loads(bytes(body))
        except ValueError as exc:
            raise InvalidEmbeddingRequest("input", f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidEmbeddingRequest("input", "the request body nests JSON too deep") from None
        body = decoded if isinstance(decoded, dict) else body
    if isinstance(body, dict) and isinstance(body.get("inputs"), list):
        return _oip_job(body)
    request = parse_body(body)
    return Job(request, request.fields())


def _oip_job(body: dict[str, Any]) -> Job:
    tensors = body["inputs"]
    if len(tensors) != 1 or not isinstance(tensors[0], dict):
        raise InvalidEmbeddingRequest("inputs", f"the embedding model takes one input tensor (BYTES texts or "
                                                f"integer token ids), got {len(tensors)}")
    tensor = tensors[0]
    datatype, shape, data = tensor.get("datatype"), tensor.get("shape"), tensor.get("data")
    if not isinstance(data, list) or not isinstance(shape, list):
        raise InvalidEmbeddingRequest("inputs", "the input tensor has no 'data' list or no 'shape'")
    where = f"inputs[0] ({tensor.get('name')!r})"
    if datatype == "BYTES":
        value: Any = _texts(data)
    elif datatype in _INT_TYPES:
        width = shape[-1] if len(shape) == 2 and isinstance(shape[-1], int) and shape[-1] > 0 else len(data)
        value = [data[i:i + width] for i in range(0, len(data), width)]
    else:
        raise InvalidEmbeddingRequest("inputs", f"{where} is {datatype}; send BYTES texts or integer token ids")
    try:
        inputs = parse_inputs(value)
    except InvalidEmbeddingRequest as exc:
        raise InvalidEmbeddingRequest(exc.field.replace("input", f"{where}.data", 1), exc.message) from None
    request = EmbeddingRequest(inputs, bare=False)
    oip = {"id": body.get("id"), "model_name": body.get("model_name")}
    return Job(request, [f"{where}.data[{i}]" for i in range(len(inputs))], oip)


def _texts(data: list[Any]) -> list[Any]:
    """BYTES elements as text: base64 decoded when every element decodes strictly to UTF-8."""
    decoded = []
    for item in data:
        if not isinstance(item, str):
            return data
        try:
            decoded.append(base64.b64decode(item, validate=True).decode("utf-8"))
        except (binascii.Error, ValueError):
            return data
    return decoded


#: Most bytes one float of a JSON answer takes with its separator (``-1.2345678901234567e-05, ``).
JSON_FLOAT_BYTES = 25
_ITEM_BYTES = 64  # an answer item's own keys (``{"object": "embedding", "index": 2047, ...}``)
_ANSWER_BYTES = 512  # the answer's envelope: model name, usage, OIP id


def answer_bound(job: Job, dimension: int, inputs: int | None = None) -> int:
    """Most bytes :func:`answer` can write for ``job`` (or for ``inputs`` inputs of its kind) with
    vectors of ``dimension`` floats: :data:`JSON_FLOAT_BYTES` a float, or the base64 text of
    ``encoding_format: "base64"``."""
    if job.oip is None and job.request.encoding_format == "base64":
        per_input = 4 * -(-4 * dimension // 3) + 2
    else:
        per_input = JSON_FLOAT_BYTES * dimension
    count = len(job.request.inputs) if inputs is None else inputs
    return _ANSWER_BYTES + count * (per_input + _ITEM_BYTES)


def answer(job: Job, vectors: np.ndarray, prompt_tokens: int, model_name: str) -> bytes:
    """The JSON answer of ``job``: OpenAI's list object (``model``: the request's, else
    ``model_name``), or a v2 response with one FP32 output ``[inputs, dimension]``."""
    if job.oip is not None:
        return json.dumps({
            "id": job.oip["id"], "model_name": job.oip["model_name"] or model_name,
            "outputs": [{"name": OIP_OUTPUT, "datatype": "FP32", "shape": list(vectors.shape),
                         "data": vectors.ravel().tolist()}],
            "parameters": {"prompt_tokens": prompt_tokens},
        }).encode()
    if job.request.encoding_format == "base64":
        data: list[Any] = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        data = vectors.tolist()
    return json.dumps({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "model": job.request.model or model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }).encode()
