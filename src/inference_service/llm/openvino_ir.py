"""OpenVINO IR for the OpenVINO engine: converted once, with optimum-intel's exporter and NNCF's
weight compression, into a cache keyed by the source model's content, the weight format and the
tools' versions (docs/llm.md, "Engines"); an LLM's IR enters it only once held to transformers
(:mod:`inference_service.llm.ir_check`). The exporter runs in a child process
(:mod:`inference_service.llm.ir_export`): it loads the torch model, about 1 GB the worker need not
keep, and ends with the process that started it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from inference_service.llm import ir_check
from inference_service.llm.exporter_run import (  # the exporter's process, as this module's callers know it
    estimate,
    exporter_environment,
    failure_reason,
    run_exporter,
)
from inference_service.llm.model import SOURCE_MARKER, ModelPreparationError, _exclusive_lock, default_cache_root

log = logging.getLogger(__name__)

#: Weight formats the exporter writes and the quality bar holds (tests/e2e/test_llm_quality.py):
#: ``fp32`` (the torch engine's greedy tokens), ``int8`` (NNCF, per output channel), ``int4``
#: (NNCF's data-aware compression of a share of the layers, :mod:`inference_service.llm.int4_export`;
#: the variants that fail the bar are not offered: benchmarks/RESULTS.md, "Issue 40").
WEIGHT_FORMATS = ("fp32", "int8", "int4")
#: The format of an archive or config naming none: the fastest within the bar (RESULTS.md, "OpenVINO engine").
DEFAULT_WEIGHT_FORMAT = "int8"
#: Largest size of the IR cache (``<root>/openvino``) by default, in GB; past it the IRs used
#: least recently are removed after a conversion.
DEFAULT_IR_CACHE_LIMIT_GB = 20
#: Files an IR directory must hold to be used.
_IR_FILES = ("openvino_model.xml", "openvino_model.bin", "config.json")
#: An IR directory holds one of these (the tokenizer transformers loads).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_COUNT_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                 "vocab_size")  # positive integers in an IR's config.json when present
#: Longest context an IR's ``config.json`` may declare (tokens): above any released model's.
MAX_CONTEXT_LENGTH = 1 << 24
_MARKER = "inference_service_ir.json"
_TOOLS = ("openvino", "optimum-intel", "nncf", "transformers")
#: Longest conversion allowed (s); SmolLM2-135M takes 10-20 s on 2 cores.
CONVERT_TIMEOUT_S = 1800.0
#: The exporter's task for a causal LM; the embedding handler exports ``feature-extraction``.
LLM_TASK = "text-generation-with-past"
#: Source files up to this size (bytes) are hashed whole; larger ones (weights) by their size and
#: three 1 MiB samples (start, middle, end), so a key costs milliseconds for any model.
_WHOLE_HASH_BYTES = 16 << 20
_SAMPLE_BYTES = 1 << 20


def tool_versions() -> dict[str, str]:
    """The converter's package versions (part of the cache key): a new exporter converts again."""
    versions = {}
    for name in _TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


def _file_digest(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if size <= _WHOLE_HASH_BYTES:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
        else:
            for offset in (0, size // 2, size - _SAMPLE_BYTES):
                handle.seek(offset)
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def source_key(model_dir: Path) -> list[tuple[str, int, str]]:
    """What identifies a model directory, wherever it lies: ``(name, size, SHA-256)`` of each
    file (large files: of their samples), hidden files and our conversion record left out."""
    if not model_dir.is_dir():
        return []
    files = []
    for path in sorted(model_dir.rglob("*")):
        name = path.relative_to(model_dir).as_posix()
        if not path.is_file() or name == SOURCE_MARKER or any(p.startswith(".") for p in name.split("/")):
            continue
        size = path.stat().st_size
        files.append((name, size, _file_digest(path, size)))
    return files


def ir_cache_dir(model_dir: str | os.PathLike[str], weight_format: str,
                 cache_dir: str | os.PathLike[str] | None = None, task: str = LLM_TASK) -> Path:
    """Where the IR of ``model_dir`` in ``weight_format`` lives in the cache:
    ``<root>/openvino/<model dir name>-<format>-<12 hex digits of the key>``, or an IR of the same
    key under another name (another copy of the files, another extraction of one archive). The key
    holds ``task`` when it is not :data:`LLM_TASK`, else the check's version (an IR made unchecked
    is converted again)."""
    source = Path(model_dir).expanduser().resolve()
    identity: dict[str, object] = {"source": source_key(source), "format": weight_format, "tools": tool_versions()}
    identity.update({"task": task} if task != LLM_TASK else {"check": ir_check.VERSION})
    if weight_format == "int4":  # its recipe and calibration text
        from inference_service.llm.int4_export import recipe_key

        identity["int4"] = recipe_key()
    key = json.dumps(identity, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", source.name)[:100].lstrip(".")  # a file name is 255 bytes
    target = root / "openvino" / f"{name or 'model'}-{weight_format}-{digest}"
    return _existing(target) or target


def _key_suffix(name: str) -> str:
    """``<format>-<digest>``: the part of an IR directory's name that is its key."""
    return "-".join(name.rsplit("-", 2)[-2:])


def _existing(target: Path) -> Path | None:
    """A complete IR of ``target``'s key, under its name or another."""
    if is_ir_dir(target):
        return target
    if not target.parent.is_dir():
        return None
    return next((p for p in sorted(target.parent.glob(f"*-{_key_suffix(target.name)}"))
                 if not p.name.startswith(".") and is_ir_dir(p)), None)


def is_ir_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds an exported model (IR, its config and tokenizer files)."""
    p = Path(path)
    return all((p / name).is_file() for name in _IR_FILES)


def export_command(model_dir: Path, target: Path, weight_format: str, task: str = LLM_TASK) -> list[str]:
    """The exporter's command line under :mod:`inference_service.llm.ir_export`, which ends it with
    this process: optimum-intel's ``optimum-cli export openvino``, or for ``int4`` (a causal LM)
    :mod:`inference_service.llm.int4_export`."""
    if weight_format not in WEIGHT_FORMATS or (weight_format == "int4" and task != LLM_TASK):
        raise ModelPreparationError(
            f"weight format {weight_format!r} is not offered; use one of: {', '.join(WEIGHT_FORMATS)}")
    command = [sys.executable, "-m", "inference_service.llm.ir_export", str(os.getpid()), str(target), "--"]
    if weight_format == "int4":
        return [*command, "int4", str(model_dir), str(target)]
    return [*command, "export", "openvino", "--model", str(model_dir), "--task", task,
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
        ModelPreparationError: names the model type and the exporter's own error (and, for an
            architecture it does not take, the ``engine: torch`` fallback); an LLM's IR that
            differs from transformers (its figures).
    """
    source = Path(model_dir).expanduser().resolve()
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    start = time.perf_counter()
    try:
        returncode, output, peak = run_exporter(export_command(source, tmp, weight_format, task), source,
                                                CONVERT_TIMEOUT_S)
        if returncode != 0 or not is_ir_dir(tmp):
            log.debug("the OpenVINO exporter failed on %s (exit status %d); its last lines:\n%s",
                      source, returncode, "\n".join(output.splitlines()[-30:]))
            reason = failure_reason(output, returncode, peak) if returncode != 0 else \
                "the exporter wrote no openvino_model.xml/.bin and config.json"
            fallback = ("; set 'engine: torch' in the handler config to serve it with the torch engine"
                        if "support" in reason.lower() else "")
            raise ModelPreparationError(
                f"cannot convert {source} (model type {model_type(source)!r}) to OpenVINO: {reason}{fallback}")
        record: dict[str, Any] = {"source": str(source), "format": weight_format, "tools": tool_versions()}
        if task == LLM_TASK:
            record["check"] = ir_check.checked(source, tmp, weight_format, exporter_environment(), CONVERT_TIMEOUT_S)
        (tmp / _MARKER).write_text(json.dumps(record), encoding="utf-8")
        for path in [*tmp.rglob("*"), tmp]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_ir_dir(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return time.perf_counter() - start


@contextlib.contextmanager
def _lock_if_free(lock_path: Path) -> Iterator[bool]:
    """Hold ``lock_path``'s ``flock`` for the block if no other process holds it; yields whether it does."""
    try:
        handle = open(lock_path, "a+b")
    except OSError:
        yield False
        return
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _lock_path(entry: Path) -> Path:
    return entry.parent / f".{_key_suffix(entry.name)}.lock"


def _remove_leftovers(target: Path) -> None:
    """Remove what an ended conversion of ``target``'s key left (called under its lock):
    temporary directories, and a ``target`` that is not a complete IR."""
    for stale in target.parent.glob(f".*-{_key_suffix(target.name)}.tmp-*"):
        log.info("removing %s, left by a conversion that did not finish", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists() and not is_ir_dir(target):
        log.info("removing %s, an incomplete IR directory", target)
        shutil.rmtree(target, ignore_errors=True)


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _last_used(entry: Path) -> float:
    try:
        return (entry / _MARKER).stat().st_mtime
    except OSError:
        return 0.0


def evict(openvino_root: Path, keep: Path, limit_bytes: int) -> list[Path]:
    """Remove the IRs used least recently until ``openvino_root`` holds at most ``limit_bytes``
    (``keep`` stays), and the temporary directories of conversions no process runs; an entry
    whose lock another process holds (converting it) is left. Returns what was removed."""
    removed = []
    for stale in openvino_root.glob(".*.tmp-*"):
        owner = openvino_root / stale.name[1:].rsplit(".tmp-", 1)[0]
        with _lock_if_free(_lock_path(owner)) as free:
            if free and stale.exists():
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(stale)
    entries = [p for p in openvino_root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    sizes = {entry: _tree_size(entry) for entry in entries}
    total = sum(sizes.values())
    for entry in sorted((e for e in entries if e != keep), key=_last_used):
        if total <= limit_bytes:
            break
        with _lock_if_free(_lock_path(entry)) as free:
            if free:
                log.info("removing the OpenVINO IR %s (%.0f MB, used least recently): the IR cache holds "
                         "over %.1f GB", entry, sizes[entry] / 1e6, limit_bytes / 1e9)
                shutil.rmtree(entry, ignore_errors=True)
                total -= sizes[entry]
                removed.append(entry)
    return removed


def prepare_ir(model_dir: str | os.PathLike[str], weight_format: str = DEFAULT_WEIGHT_FORMAT,
               cache_dir: str | os.PathLike[str] | None = None,
               cache_limit_gb: float = DEFAULT_IR_CACHE_LIMIT_GB, task: str = LLM_TASK) -> tuple[Path, float | None]:
    """``(IR directory, conversion seconds or None when cached)`` of ``model_dir``; one process
    converts, others wait on a lock file; after a conversion the cache is trimmed to
    ``cache_limit_gb`` (:func:`evict`). An LLM's IR gets its OpenVINO tokenizer and detokenizer
    (:func:`add_detokenizer`), so an archive built from it serves structured outputs.
    ModelPreparationError for an unknown weight format or a failed conversion."""
    if weight_format not in WEIGHT_FORMATS:
        raise ModelPreparationError(
            f"weight format {weight_format!r} is not offered; use one of: {', '.join(WEIGHT_FORMATS)}")
    target = ir_cache_dir(model_dir, weight_format, cache_dir, task)
    seconds: float | None = None
    if not is_ir_dir(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(_lock_path(target)):
            found = _existing(target)  # converted meanwhile, perhaps under another name
            if found is None:
                _remove_leftovers(target)
                log.info("converting %s to OpenVINO IR (%s), once: %s", model_dir, weight_format,
                         estimate(Path(model_dir), weight_format))
                seconds = convert(model_dir, target, weight_format, task)
                log.info("converted %s to OpenVINO IR (%s) in %.1f s", model_dir, weight_format, seconds)
                evict(target.parent, target, int(cache_limit_gb * 1e9))
            else:
                target = found
    if seconds is None:
        with contextlib.suppress(OSError):  # last use, for eviction (a read-only cache is not marked)
            os.utime(target / _MARKER)
    if task == LLM_TASK:  # the pipeline reads the vocabulary structured outputs need from it
        add_detokenizer(target)
    return target, seconds


def looks_like_ir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is meant as an IR directory (it holds ``openvino_model.xml``), complete or not."""
    return (Path(path) / "openvino_model.xml").is_file()


def read_ir_config(ir_dir: Path) -> dict[str, Any]:
    """The IR directory's ``config.json``, after checking the directory holds the model, its
    config and a tokenizer, and that the config's counts are positive integers
    (``max_position_embeddings`` at most :data:`MAX_CONTEXT_LENGTH`).

    Raises:
        ModelPreparationError: names the directory or file and the field at fault.
    """
    missing = [name for name in _IR_FILES if not (ir_dir / name).is_file()]
    if missing:
        raise ModelPreparationError(f"IR directory {ir_dir} has no {' or '.join(missing)}")
    if not any((ir_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelPreparationError(f"IR directory {ir_dir} has no tokenizer ({' or '.join(_TOKENIZER_FILES)})")
    path = ir_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelPreparationError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelPreparationError(f"{path} must hold a JSON object, not {type(config).__name__}")
    for field in (*_COUNT_FIELDS, "max_position_embeddings"):
        value = config.get(field)
        if value is None:
            continue
        high = MAX_CONTEXT_LENGTH if field == "max_position_embeddings" else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (high and value > high):
            bound = f" up to {high:,}" if high else ""
            raise ModelPreparationError(f"{path}: '{field}' must be a positive integer{bound}, got {value!r}")
    return config


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
