"""The rerank handler: a cross-encoder's score of each (query, document) pair. The requests of one
batch (TorchServe's ``batchSize`` / ``maxBatchDelay`` gather them across clients) are tokenized
as pairs cut to the model's length, all their pairs sorted by length and run through the engine
``max_batch_inputs`` at a time (the embedding handler's length groups), so one forward pass holds
the pairs of several clients' queries; each request gets its own answer. See docs/rerank.md.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import numpy as np

from inference_service.contracts.cpu import positive_int
from inference_service.contracts.rerank import InvalidRerankRequest, RerankRequest, parse_body
from inference_service.contracts.text import lone_surrogate, lone_surrogate_message
from inference_service.embeddings.engines import engine_name
from inference_service.embeddings.handler import length_groups, prepare_rows, response_limit
from inference_service.handler import BaseHandler, Context
from inference_service.rerank.engines import Pair, Scorer, build_engine
from inference_service.rerank.model import RerankSettings, model_dir_of, settings_of

log = logging.getLogger(__name__)

#: Pairs one forward pass takes by default (sentence-transformers' ``CrossEncoder.predict`` batch_size).
DEFAULT_MAX_BATCH_INPUTS = 32
#: Most bytes an answer item takes besides its document's JSON text (``{"index": 999,
#: "relevance_score": -1.2345678901234567e-05, "document": {"text": }}, ``), and the envelope's.
_ITEM_BYTES = 96
_ANSWER_BYTES = 512


class PairEncoder:
    """Pairs to token ids with the model's own ``tokenizer.json``, cut to ``max_length`` tokens
    the longer text first (``longest_first``, as transformers' tokenizers cut for ``CrossEncoder``)."""

    def __init__(self, tokenizer_file: str, max_length: int) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_file)
        pad = (self.tokenizer.padding or {}).get("pad_id")
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length, strategy="longest_first")
        for token in ("[PAD]", "<pad>"):
            pad = pad if pad is not None else self.tokenizer.token_to_id(token)
        self.pad_id = pad if pad is not None else 0

    def encode(self, request: RerankRequest) -> list[Pair]:
        """One :class:`Pair` a pair of ``request``; InvalidRerankRequest for a lone surrogate."""
        first_field = "query" if request.kind == "rerank" else "text_1"
        checks = [(request.pairs[0][0], first_field)] if request.kind == "rerank" else \
            [(first, first_field) for first, _ in request.pairs]
        checks += [(second, field) for (_, second), field in zip(request.pairs, request.fields, strict=True)]
        for text, field in checks:
            found = lone_surrogate(text, field)
            if found is not None:
                raise InvalidRerankRequest(field, lone_surrogate_message(None, found[1]))
        encodings = self.tokenizer.encode_batch(request.pairs)
        return [Pair(list(e.ids), list(e.type_ids)) for e in encodings]


class RerankHandler(BaseHandler):
    """One score a pair, requests batched together (see the module docstring).

    ``handler:`` keys: ``model_path`` (a cross-encoder folder; required), ``engine`` (``openvino``
    on CPU, ``torch``), ``weight_format`` (``fp32``, ``int8``), ``activation`` (``sigmoid``,
    ``identity``; default: the model's, sigmoid), ``max_length`` (default: the model's own),
    ``max_batch_inputs`` (32), ``cache_dir``, ``torch_threads``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.engine: Scorer | None = None
        self.encoder: PairEncoder | None = None
        self.settings: RerankSettings | None = None
        self.max_batch_inputs = DEFAULT_MAX_BATCH_INPUTS

    def initialize(self, context: Context) -> None:
        """Read the ``handler`` config, convert the model to IR once (``openvino``), load it, warm it up.

        Raises:
            ValueError: a bad config value (the message names the key).
            inference_service.llm.model.ModelPreparationError: the model cannot be found or converted.
        """
        config, properties = self.adopt(context)
        gpu_id = properties.get("gpu_id")
        name = engine_name(config, gpu_id is not None)
        device = f"cuda:{gpu_id}" if gpu_id is not None and name == "torch" else "cpu"
        self.max_batch_inputs = positive_int(config, "max_batch_inputs", DEFAULT_MAX_BATCH_INPUTS) or 1
        model_dir = model_dir_of(config)
        self.settings = settings_of(model_dir, config)
        self.encoder = PairEncoder(str(model_dir / "tokenizer.json"), self.settings.max_length)
        self.engine = build_engine(name, model_dir, config, device=device, pad_id=self.encoder.pad_id)
        start = time.perf_counter()
        self.engine.logits(self.encoder.encode(RerankRequest("score", [("warm", "up")], ["text_2"])))
        log.info("rerank model ready: %s engine, %s activation, at most %d tokens a pair; warm-up took %.2f s",
                 name, self.settings.activation, self.settings.max_length, time.perf_counter() - start)
        self.initialized = True

    def handle(self, data: list[Any], context: Context) -> list[Any]:
        """One answer per request of the batch: its JSON, or its error message with status 400
        (413: an answer past ``max_response_size``) set; a bad request fails alone, a forward-pass
        failure the whole batch."""
        engine, encoder = self.engine, self.encoder
        if engine is None or encoder is None:
            raise RuntimeError("RerankHandler.initialize was not called")
        self.context = context
        start = time.perf_counter()

        def prepare(row: Any) -> tuple[RerankRequest, list[Pair]]:
            request = read_row(row)
            self._check_answer_size(request)
            return request, encoder.encode(request)

        results, jobs = prepare_rows(data, context, prepare)
        scores = self._scores([pair for _, pairs in jobs.values() for pair in pairs])
        offset = 0
        for idx, (request, pairs) in jobs.items():
            tokens = sum(len(pair.ids) for pair in pairs)
            results[idx] = answer(request, scores[offset:offset + len(pairs)], tokens, context.model_name)
            offset += len(pairs)
            context.metrics.add_counter("PromptTokens", tokens, idx)
        if jobs:  # one line a call: how many requests its batch gathered
            log.info("batch of %d requests: %d pairs scored in %.3f s", len(jobs), offset, time.perf_counter() - start)
        return results

    def _scores(self, pairs: list[Pair]) -> np.ndarray:
        """Scores of ``pairs`` in their order, computed longest first in length groups."""
        assert self.engine is not None and self.settings is not None
        logits = np.empty(len(pairs), dtype=np.float32)
        for chosen in length_groups([len(pair.ids) for pair in pairs], self.max_batch_inputs):
            logits[chosen] = self.engine.logits([pairs[i] for i in chosen])
        if self.settings.activation == "sigmoid":
            return (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)
        return logits

    def _check_answer_size(self, request: RerankRequest) -> None:
        """Refuse (413) a request whose answer could pass the server's ``max_response_size``, before
        any work, naming the limit."""
        limit = response_limit(self.context)
        bound = answer_bound(request)
        if limit and bound > limit:
            field = "documents" if request.kind == "rerank" else "text_2"
            hint = "; set return_documents false or a smaller top_n" if request.kind == "rerank" else ""
            raise InvalidRerankRequest(field, f"the answer to {len(request.pairs)} texts could take {bound} bytes, "
                                              f"more than max_response_size={limit}{hint}", status=413)


def read_row(row: Any) -> RerankRequest:
    """The request of one row of the handler's batch (its ``data`` or ``body`` input).

    Raises:
        InvalidRerankRequest: no body, or a body :func:`parse_body` refuses.
    """
    body = row.get("data") if isinstance(row, dict) else row
    if body is None and isinstance(row, dict):
        body = row.get("body")
    if body is None:
        raise InvalidRerankRequest("query", "the request has no 'data' or 'body' input")
    return parse_body(body)


def answer_bound(request: RerankRequest) -> int:
    """Most bytes :func:`answer` can write for ``request``: the documents it returns as JSON text
    (the ``top_n`` longest) and :data:`_ITEM_BYTES` an item."""
    count = len(request.pairs) if request.top_n is None else min(request.top_n, len(request.pairs))
    texts = 0
    if request.kind == "rerank" and request.return_documents:
        sizes = sorted((len(json.dumps(second)) for _, second in request.pairs), reverse=True)
        texts = sum(sizes[:count])
    return _ANSWER_BYTES + len(request.model or "") + count * _ITEM_BYTES + texts


def answer(request: RerankRequest, scores: np.ndarray, tokens: int, model_name: str) -> bytes:
    """The JSON answer: rerank's results sorted by score, highest first (ties: the earlier
    document first), cut to ``top_n``; or score's list in the pairs' order, as vLLM answers them."""
    model = request.model or model_name
    values = [float(score) for score in scores]
    if request.kind == "score":
        return json.dumps({
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": value} for i, value in enumerate(values)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }).encode()
    order = sorted(range(len(values)), key=lambda i: -values[i])[:request.top_n or len(values)]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": values[i]}
        if request.return_documents:
            item["document"] = {"text": request.pairs[i][1]}
        results.append(item)
    return json.dumps({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
                       "results": results}).encode()
