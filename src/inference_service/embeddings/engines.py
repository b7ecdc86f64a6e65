"""The embedding handler's two engines behind one interface: ``openvino`` (OpenVINO GenAI's
``TextEmbeddingPipeline`` on the model's IR, the default on CPU) and ``torch`` (transformers'
``AutoModel`` with the pooling done here, the default on a GPU and for models the exporter cannot
convert). docs/embeddings.md, "Engines".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from inference_service.embeddings.model import (
    DEFAULT_WEIGHT_FORMAT,
    EmbeddingSettings,
    prepare_ir,
)

log = logging.getLogger(__name__)

ENGINES = ("openvino", "torch")


@dataclass(frozen=True, slots=True)
class Encoded:
    """One input, tokenized: ``ids`` as the model reads them (special tokens included) and
    ``text`` (the request's, or its token ids decoded: what the OpenVINO pipeline tokenizes)."""

    ids: list[int]
    text: str


class Embedder(Protocol):
    """An engine: one forward pass over a batch of inputs."""

    name: str
    #: Whether the engine reads ``Encoded.text`` (it tokenizes) rather than ``Encoded.ids``.
    reads_text: bool

    def embed(self, batch: Sequence[Encoded]) -> np.ndarray:
        """``[len(batch), dimension]`` float32: one vector per input, pooled (and normalized as
        the settings say)."""
        ...


def engine_name(config: Mapping[str, Any], on_gpu: bool) -> str:
    """``engine`` when set, else ``openvino`` on CPU and ``torch`` on a GPU.

    Raises:
        ValueError: an unknown engine, or ``openvino`` on a GPU worker (the message names the key).
    """
    value = config.get("engine")
    if value is None:
        return "torch" if on_gpu else "openvino"
    if value not in ENGINES:
        raise ValueError(f"handler config: 'engine' must be one of {', '.join(ENGINES)}, got {value!r}")
    if value == "openvino" and on_gpu:
        raise ValueError("handler config: 'engine: openvino' runs on CPU only; use 'engine: torch' on a GPU")
    return str(value)


def worker_threads() -> int | None:
    """The intra-op threads the worker chose (``OMP_NUM_THREADS``: ``torch_threads`` or its share
    of the CPUs), ``None`` when unset."""
    try:
        value = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return value if value > 0 else None


class OpenVINOEmbedder:
    """``TextEmbeddingPipeline`` on an IR directory, in f32 precision (bf16 on CPUs that have it
    would move the vectors past sentence-transformers' by more than 1e-3)."""

    name = "openvino"
    reads_text = True

    def __init__(self, ir_dir: Path, settings: EmbeddingSettings, threads: int | None = None) -> None:
        import openvino_genai as ov_genai

        pipeline = ov_genai.TextEmbeddingPipeline
        config = pipeline.Config()
        config.pooling_type = {"mean": pipeline.PoolingType.MEAN, "cls": pipeline.PoolingType.CLS,
                               "last_token": pipeline.PoolingType.LAST_TOKEN}[settings.pooling]
        config.normalize = settings.normalize
        config.max_length = settings.max_length
        properties: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32"}
        if threads is not None:
            properties["INFERENCE_NUM_THREADS"] = threads
        self.pipeline = pipeline(str(ir_dir), "CPU", config, **properties)

    def embed(self, batch: Sequence[Encoded]) -> np.ndarray:
        return np.asarray(self.pipeline.embed_documents([item.text for item in batch]), dtype=np.float32)


class TorchEmbedder:
    """transformers' ``AutoModel`` on ``device``; pooling as sentence-transformers' ``Pooling``
    (mean over the attention mask, the first token, or the last one), then L2 normalization."""

    name = "torch"
    reads_text = False

    def __init__(self, model_dir: Path, settings: EmbeddingSettings, device: str, pad_id: int) -> None:
        import torch
        from transformers import AutoModel

        self.settings = settings
        self.device = torch.device(device)
        self.pad_id = pad_id
        self.model = AutoModel.from_pretrained(str(model_dir), local_files_only=True).to(self.device).eval()

    def embed(self, batch: Sequence[Encoded]) -> np.ndarray:
        import torch

        lengths = torch.tensor([len(item.ids) for item in batch])
        ids = torch.full((len(batch), int(lengths.max())), self.pad_id, dtype=torch.long)
        for row, item in enumerate(batch):
            ids[row, :len(item.ids)] = torch.tensor(item.ids)
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        with torch.inference_mode():
            states = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
            if self.settings.pooling == "cls":
                pooled = states[:, 0]
            elif self.settings.pooling == "last_token":
                pooled = states[torch.arange(len(batch), device=self.device), lengths.to(self.device) - 1]
            else:
                weights = mask.to(self.device, states.dtype).unsqueeze(-1)
                pooled = (states * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            if self.settings.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return pooled.float().cpu().numpy()


def set_torch_threads(config: Mapping[str, Any]) -> None:
    """torch's intra-op threads from the handler config's ``torch_threads`` (a positive integer; else
    left as the worker set them)."""
    threads = config.get("torch_threads")
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0:
        import torch

        torch.set_num_threads(threads)


def build_engine(name: str, model_dir: Path, settings: EmbeddingSettings, config: Mapping[str, Any], *,
                 device: str, pad_id: int) -> Embedder:
    """The engine ``name`` for ``model_dir``; ``openvino`` converts the model once to IR in
    ``weight_format`` (``cache_dir``: the cache root).

    Raises:
        ModelPreparationError: the model cannot be converted or loaded.
    """
    start = time.perf_counter()
    if name == "torch":
        set_torch_threads(config)
        torch_engine = TorchEmbedder(model_dir, settings, device, pad_id)
        log.info("loaded %s (torch, %s) in %.1f s", model_dir, device, time.perf_counter() - start)
        return torch_engine
    cache_dir = config.get("cache_dir")
    ir_dir, seconds = prepare_ir(model_dir, str(config.get("weight_format", DEFAULT_WEIGHT_FORMAT)),
                                 str(cache_dir) if cache_dir else None)
    if seconds is not None:
        log.info("no OpenVINO IR was cached: converting took %.1f s", seconds)
    engine = OpenVINOEmbedder(ir_dir, settings, worker_threads())
    log.info("loaded %s (OpenVINO IR) in %.1f s", ir_dir, time.perf_counter() - start)
    return engine
