"""Fixtures shared by the unit tests (the root tests/conftest.py still applies)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The real SmolLM2 tokenizer (converted cache dir if present, else the GGUF)."""
    from transformers import AutoTokenizer

    from inference_service.llm.model import converted_model_dir, find_default_gguf, is_model_dir

    gguf = find_default_gguf()
    converted = converted_model_dir(gguf)
    if is_model_dir(converted):
        return AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
