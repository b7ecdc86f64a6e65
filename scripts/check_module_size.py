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


def sizes() -> dict[str, int]:
    """Lines of every module, by path relative to the repository (generated stubs left out)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(part in SKIP for part in path.relative_to(PACKAGE).parts):
            continue
        out[str(path.relative_to(ROOT))] = len(path.read_text(encoding="utf-8").splitlines())
    return out


def main() -> int:
    lines = sizes()
    too_long = {path: n for path, n in lines.items() if n > LIMIT}
    for path, n in too_long.items():
        print(f"{path}: {n} lines (limit {LIMIT}): split it along its seams")
    if not too_long:
        print(f"every one of {len(lines)} modules is at most {LIMIT} lines")
    return 1 if too_long else 0


if __name__ == "__main__":
    sys.exit(main())
