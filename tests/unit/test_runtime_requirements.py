"""What a plain ``scripts/install`` provides for the README's commands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _names(path: Path) -> set[str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {re.split(r"[<>=!~\[ ]", line)[0].lower() for line in lines if line}


def test_openai_client_is_a_runtime_requirement():
    """The README's OpenAI example imports ``openai``: a plain install (requirements.txt) has it."""
    assert "openai" in _names(ROOT / "requirements.txt")
    assert "openai" not in _names(ROOT / "requirements-dev.txt")  # one place for it
    install = (ROOT / "scripts" / "install").read_text()
    assert '-r requirements.txt' in install
