"""OpenVINO IR for the OpenVINO engine: converted once, with optimum-intel's exporter and NNCF's
weight compression, into a cache keyed by the source model, the weight format and the tools'
versions (docs/llm.md, "Engines"). The exporter runs in a child process: it loads the torch
model, about 1 GB the worker need not keep."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from inference_service.llm.model import ModelPreparationError, _exclusive_lock, default_cache_root

log = logging.getLogger(__name__)

#: Weight formats the exporter writes and the quality bar holds (tests/e2e/test_llm_quality.py):
#: ``fp32`` (the torch engine's greedy tokens), ``int8`` (NNCF, per output channel). int4 was
#: measured at +27 % perplexity (data-free, group 32) and is not offered.
WEIGHT_FORMATS = ("fp32", "int8")
#: The weight format of an archive or handler config that names none: the fastest one within
#: the quality bar (benchmarks/RESULTS.md, "OpenVINO engine").
DEFAULT_WEIGHT_FORMAT = "int8"
#: Files an IR directory must hold to be used.
_IR_FILES = ("openvino_model.xml", "openvino_model.bin", "config.json")
_MARKER = "inference_service_ir.json"
_TOOLS = ("openvino", "optimum-intel", "nncf", "transformers")
#: Longest conversion allowed (s); SmolLM2-135M takes 10-20 s on 2 cores.
CONVERT_TIMEOUT_S = 1800.0
#: The exporter's task for a causal LM; the embedding handler exports ``feature-extraction``.
LLM_TASK = "text-generation-with-past"


def tool_versions() -> dict[str, str]:
    """The converter's package versions (part of the cache key): a new exporter converts again."""
    versions = {}
    for name in _TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


def _source_key(model_dir: Path) -> dict[str, object]:
    """What identifies a model directory: its path and its files' names, sizes and times."""
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in model_dir.iterdir()
                   if p.is_file()) if model_dir.is_dir() else []
    return {"model_dir": str(model_dir), "files": files}


def ir_cache_dir(model_dir: str | os.PathLike[str], weight_format: str,
                 cache_dir: str | os.PathLike[str] | None = None, task: str = LLM_TASK) -> Path:
    """Where the IR of ``model_dir`` in ``weight_format`` lives in the cache (existing or not):
    ``<root>/openvino/<model dir name>-<format>-<12 hex digits of the key>`` (the key holds
    ``task`` when it is not :data:`LLM_TASK`)."""
    source = Path(model_dir).expanduser().resolve()
    identity: dict[str, object] = {"source": _source_key(source), "format": weight_format, "tools": tool_versions()}
    if task != LLM_TASK:
        identity["task"] = task
    key = json.dumps(identity, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / "openvino" / f"{source.name[:100]}-{weight_format}-{digest}"  # a file name is 255 bytes


def is_ir_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds an exported model (IR, its config and tokenizer files)."""
    p = Path(path)
    return all((p / name).is_file() for name in _IR_FILES)


def export_command(model_dir: Path, target: Path, weight_format: str, task: str = LLM_TASK) -> list[str]:
    """The exporter's command line (optimum-intel's ``optimum-cli export openvino``)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ModelPreparationError(
            f"weight format {weight_format!r} is not offered; use one of: {', '.join(WEIGHT_FORMATS)}")
    return [sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino",
            "--model", str(model_dir), "--task", task,
            "--weight-format", weight_format, str(target)]


def model_type(model_dir: Path) -> str:
    """``config.json``'s ``model_type`` (``"unknown"`` when unreadable), for error messages."""
    try:
        return str(json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("model_type"))
    except (OSError, ValueError, AttributeError):
        return "unknown"


def convert(model_dir: str | os.PathLike[str], target: str | os.PathLike[str], weight_format: str,
            task: str = LLM_TASK) -> float:
    """Export ``model_dir`` to ``target`` (through a temporary sibling); returns the seconds it took.

    Raises:
        ModelPreparationError: names the model type, the exporter's last error line and the
            ``engine: torch`` fallback.
    """
    source = Path(model_dir).expanduser().resolve()
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    start = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    try:
        try:
            done = subprocess.run(export_command(source, tmp, weight_format, task), env=env, capture_output=True,
                                  text=True, timeout=CONVERT_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise ModelPreparationError(
                f"converting {source} to OpenVINO took over {CONVERT_TIMEOUT_S:.0f} s; set 'engine: torch' "
                "in the handler config to serve it with the torch engine") from None
        if done.returncode != 0 or not is_ir_dir(tmp):
            lines = [line for line in (done.stderr or "").splitlines() if line.strip()]
            reason = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
            raise ModelPreparationError(
                f"cannot convert {source} (model type {model_type(source)!r}) to OpenVINO: {reason[:300]}; "
                "set 'engine: torch' in the handler config to serve it with the torch engine")
        (tmp / _MARKER).write_text(json.dumps({"source": _source_key(source), "format": weight_format,
                                                "tools": tool_versions()}), encoding="utf-8")
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_ir_dir(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return time.perf_counter() - start


def prepare_ir(model_dir: str | os.PathLike[str], weight_format: str = DEFAULT_WEIGHT_FORMAT,
               cache_dir: str | os.PathLike[str] | None = None, task: str = LLM_TASK) -> tuple[Path, float | None]:
    """``(IR directory, conversion seconds or None when cached)`` of ``model_dir``; one process
    converts, others wait on a lock file. ModelPreparationError for an unknown weight format or a
    failed conversion."""
    if weight_format not in WEIGHT_FORMATS:
        raise ModelPreparationError(
            f"weight format {weight_format!r} is not offered; use one of: {', '.join(WEIGHT_FORMATS)}")
    target = ir_cache_dir(model_dir, weight_format, cache_dir, task)
    if is_ir_dir(target):
        return target, None
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_ir_dir(target):
            return target, None
        log.info("converting %s to OpenVINO IR (%s), once", model_dir, weight_format)
        seconds = convert(model_dir, target, weight_format, task)
        log.info("converted %s to OpenVINO IR (%s) in %.1f s", model_dir, weight_format, seconds)
        return target, seconds


#: The OpenVINO tokenizer models beside an IR: OpenVINO GenAI reads its vocabulary from the
#: detokenizer (structured outputs need it); optimum-intel's exporter writes them when it can.
TOKENIZER_FILES = ("openvino_tokenizer.xml", "openvino_detokenizer.xml")


def add_detokenizer(ir_dir: Path) -> bool:
    """Write the OpenVINO tokenizer and detokenizer of ``ir_dir``'s transformers tokenizer beside its
    IR, once (openvino-tokenizers' converter); True when they are there. The exporter leaves them
    out when the converter fails on the tokenizer's decoder: a byte-level tokenizer is then
    converted with ``ByteLevel`` as its only decoder step (its tokens' bytes are the same).
    """
    if all((ir_dir / name).is_file() for name in TOKENIZER_FILES):
        return True
    with _exclusive_lock(ir_dir.parent / f".{ir_dir.name}.lock"):
        if all((ir_dir / name).is_file() for name in TOKENIZER_FILES):
            return True
        start = time.perf_counter()
        try:
            models = _convert_tokenizer(ir_dir)
        except Exception as exc:  # noqa: BLE001 - the converter's failures are of every kind; the model still serves
            log.warning("cannot convert the tokenizer of %s to OpenVINO (%s: %s): structured outputs are off "
                        "for this model", ir_dir, type(exc).__name__, str(exc).strip().splitlines()[0][:200])
            return False
        import openvino

        for name, model in zip(TOKENIZER_FILES, models, strict=True):
            tmp = ir_dir / f".{name}.tmp.xml"
            openvino.save_model(model, str(tmp))
            os.replace(tmp.with_suffix(".bin"), (ir_dir / name).with_suffix(".bin"))
            os.replace(tmp, ir_dir / name)
        log.info("wrote the OpenVINO tokenizer of %s in %.1f s", ir_dir, time.perf_counter() - start)
        return True


def _convert_tokenizer(ir_dir: Path) -> tuple[object, object]:
    """openvino-tokenizers' ``(tokenizer, detokenizer)`` models of the IR directory's tokenizer."""
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ir_dir))
    try:
        return tuple(convert_tokenizer(tokenizer, with_detokenizer=True))  # type: ignore[return-value]
    except RuntimeError:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or '"ByteLevel"' not in backend.to_str() or "ByteLevel" not in str(backend.pre_tokenizer):
            raise
        from tokenizers import decoders

        backend.decoder = decoders.ByteLevel()
        return tuple(convert_tokenizer(tokenizer, with_detokenizer=True))  # type: ignore[return-value]
