"""The rerank handler's two engines behind one interface, both reading the pairs as this
handler tokenized them, so that one forward pass holds pairs of several requests (queries):
``openvino`` (the OpenVINO runtime on the model's IR, the default on CPU) and ``torch``
(transformers' ``AutoModelForSequenceClassification``, the default on a GPU). OpenVINO GenAI's
``TextRerankPipeline`` takes one query a call, and measured no faster on 2 cores
(benchmarks/RESULTS.md, "Rerank against sentence-transformers"). docs/rerank.md, "Engines".
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from inference_service.embeddings.engines import set_torch_threads, worker_threads
from inference_service.rerank.model import DEFAULT_WEIGHT_FORMAT, prepare_ir

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pair:
    """One pair, tokenized and cut to the model's length: ``ids`` (special tokens included) and
    ``type_ids`` (0 for the first text, 1 for the second, as BERT's segment embeddings read them)."""

    ids: list[int]
    type_ids: list[int]


class Scorer(Protocol):
    """An engine: one forward pass over a batch of pairs."""

    name: str

    def logits(self, batch: Sequence[Pair]) -> np.ndarray:
        """``[len(batch)]`` float32: the model's one logit a pair."""
        ...


def padded(batch: Sequence[Pair], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids, token_type_ids, attention_mask)``, int64 ``[len(batch), longest]``, padded right."""
    longest = max(len(pair.ids) for pair in batch)
    ids = np.full((len(batch), longest), pad_id, dtype=np.int64)
    types = np.zeros((len(batch), longest), dtype=np.int64)
    mask = np.zeros((len(batch), longest), dtype=np.int64)
    for row, pair in enumerate(batch):
        ids[row, :len(pair.ids)] = pair.ids
        types[row, :len(pair.type_ids)] = pair.type_ids
        mask[row, :len(pair.ids)] = 1
    return ids, types, mask


class OpenVINOScorer:
    """The IR's ``openvino_model.xml`` compiled for CPU in f32 precision with the latency hint
    (one stream on the worker's threads: faster than the default on 2 cores, measured)."""

    name = "openvino"

    def __init__(self, ir_dir: Path, pad_id: int, threads: int | None = None) -> None:
        import openvino as ov

        properties: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
        if threads is not None:
            properties["INFERENCE_NUM_THREADS"] = threads
        self.model = ov.Core().compile_model(str(ir_dir / "openvino_model.xml"), "CPU", properties)
        self.inputs = {port.get_any_name() for port in self.model.inputs}
        self.request = self.model.create_infer_request()
        self.pad_id = pad_id

    def logits(self, batch: Sequence[Pair]) -> np.ndarray:
        ids, types, mask = padded(batch, self.pad_id)
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        out = self.request.infer({name: value for name, value in feed.items() if name in self.inputs})
        return np.asarray(out[0], dtype=np.float32).reshape(len(batch), -1)[:, 0]


class TorchScorer:
    """transformers' ``AutoModelForSequenceClassification`` on ``device``; ``token_type_ids`` go to
    models whose ``forward`` takes them."""

    name = "torch"

    def __init__(self, model_dir: Path, device: str, pad_id: int) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        self.device = torch.device(device)
        self.pad_id = pad_id
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir), local_files_only=True).to(self.device).eval()
        self.takes_types = "token_type_ids" in inspect.signature(self.model.forward).parameters

    def logits(self, batch: Sequence[Pair]) -> np.ndarray:
        import torch

        ids, types, mask = padded(batch, self.pad_id)
        kwargs = {"input_ids": torch.from_numpy(ids).to(self.device),
                  "attention_mask": torch.from_numpy(mask).to(self.device)}
        if self.takes_types:
            kwargs["token_type_ids"] = torch.from_numpy(types).to(self.device)
        with torch.inference_mode():
            return self.model(**kwargs).logits[:, 0].float().cpu().numpy()


def build_engine(name: str, model_dir: Path, config: Mapping[str, Any], *, device: str, pad_id: int) -> Scorer:
    """The engine ``name`` for ``model_dir``; ``openvino`` converts the model once to IR in
    ``weight_format`` (``cache_dir``: the cache root).

    Raises:
        ModelPreparationError: the model cannot be converted or loaded.
    """
    start = time.perf_counter()
    if name == "torch":
        set_torch_threads(config)
        engine: Scorer = TorchScorer(model_dir, device, pad_id)
        log.info("loaded %s (torch, %s) in %.1f s", model_dir, device, time.perf_counter() - start)
        return engine
    cache_dir = config.get("cache_dir")
    ir_dir, seconds = prepare_ir(model_dir, str(config.get("weight_format", DEFAULT_WEIGHT_FORMAT)),
                                 str(cache_dir) if cache_dir else None)
    if seconds is not None:
        log.info("no OpenVINO IR was cached: converting took %.1f s", seconds)
    engine = OpenVINOScorer(ir_dir, pad_id, worker_threads())
    log.info("loaded %s (OpenVINO IR) in %.1f s", ir_dir, time.perf_counter() - start)
    return engine
