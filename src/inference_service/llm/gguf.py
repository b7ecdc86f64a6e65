"""What the engine must know of a GGUF file it serves as it is: its context length and its KV cache's
shape per token, read from the file's metadata with the ``gguf`` package (llama.cpp's reader) once
and cached beside the other conversions (``<cache root>/gguf/``), since the reader walks every field
and tensor of the file (seconds)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from inference_service.llm.model import ModelPreparationError, default_cache_root

#: Bumped when :class:`GGUFShape` changes: older cache entries are read again.
_VERSION = 1


@dataclass(frozen=True)
class GGUFShape:
    """``context_length`` (tokens), and the KV cache's ``layers``, ``kv_heads`` and ``head_dim``."""

    architecture: str
    context_length: int
    layers: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes one token takes in the KV cache (keys and values) at ``element_bytes`` per value."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


def gguf_shape(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> GGUFShape:
    """The shape of the GGUF model at ``path`` (cached by its path, size and modification time).

    Raises:
        ModelPreparationError: the file cannot be read or lacks the architecture's keys.
    """
    source = Path(path).expanduser().resolve()
    try:
        stat = source.stat()
    except OSError as exc:
        raise ModelPreparationError(f"cannot read the GGUF file {source}: {exc.strerror}") from None
    key = hashlib.sha256(f"{_VERSION}\0{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    cached = root / "gguf" / f"{source.stem[:100]}-{key}.json"
    try:
        return GGUFShape(**json.loads(cached.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        pass
    shape = _read_shape(source)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(asdict(shape)), encoding="utf-8")
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only cache: read the file again next time
    return shape


def _read_shape(source: Path) -> GGUFShape:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(source))
    except (OSError, ValueError) as exc:
        raise ModelPreparationError(f"cannot read the GGUF file {source}: {exc}") from None

    def value(name: str) -> object:
        field = reader.fields.get(name)
        return field.contents() if field is not None else None

    arch = value("general.architecture")
    if not isinstance(arch, str):
        raise ModelPreparationError(f"{source} has no general.architecture: not a GGUF model file")
    numbers = {key: value(f"{arch}.{key}") for key in (
        "context_length", "block_count", "attention.head_count", "attention.head_count_kv", "embedding_length",
        "attention.key_length")}
    for key in ("context_length", "block_count", "attention.head_count", "embedding_length"):
        number = numbers[key]
        if not isinstance(number, int) or number < 1:
            raise ModelPreparationError(f"{source}: {arch}.{key} must be a positive integer, got {number!r}")
    heads = int(numbers["attention.head_count"])  # type: ignore[call-overload]
    kv_heads = numbers["attention.head_count_kv"]
    head_dim = numbers["attention.key_length"]
    return GGUFShape(
        architecture=arch,
        context_length=int(numbers["context_length"]),  # type: ignore[call-overload]
        layers=int(numbers["block_count"]),  # type: ignore[call-overload]
        kv_heads=kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else heads,
        head_dim=head_dim if isinstance(head_dim, int) and head_dim > 0
        else int(numbers["embedding_length"]) // heads,  # type: ignore[call-overload]
    )
