#!/usr/bin/env python3
"""Fail when a module of ``src/inference_service`` is longer than :data:`LIMIT` lines.

A long module holds more than one role: split it along its seams (issue 32). Generated
stubs (``_proto``) are left out.

Usage: ``.venv/bin/python scripts/check_module_size.py``. Exit status 1 and one line per
module over the limit.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "inference_service"
SKIP = ("_proto",)
LIMIT = 450


def too_long() -> list[tuple[str, int]]:
    """``(path relative to the repository, lines)`` of every module over :data:`LIMIT`."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(part in SKIP for part in path.relative_to(PACKAGE).parts):
            continue
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > LIMIT:
            out.append((str(path.relative_to(ROOT)), lines))
    return out


def main() -> int:
    long_modules = too_long()
    for path, lines in long_modules:
        print(f"{path}: {lines} lines (limit {LIMIT}): split it along its seams")
    return 1 if long_modules else 0


if __name__ == "__main__":
    sys.exit(main())
