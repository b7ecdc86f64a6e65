#!/usr/bin/env python3
"""Print the share of ``src/inference_service`` lines that are docstrings.

A docstring line is one inside the span of a module, class or function docstring
(the string expression's first to last line, found with ``ast``); generated stubs
(``_proto``) are left out. The style guide (practice 15) wants
docstrings that say what the code cannot; issue 32 caps them at 18 % of the lines.

Usage: ``.venv/bin/python scripts/docstring_share.py [--max PCT] [--top N]``; exit
status 1 when the share is above ``--max``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "inference_service"
SKIP = ("_proto",)

_DOC_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstring_lines(source: str) -> int:
    """Number of lines inside the docstrings of ``source``'s module, classes and functions."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, _DOC_OWNERS) or not node.body:
            continue
        first = node.body[0]
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return len(lines)


def measure(package: Path = PACKAGE) -> dict[Path, tuple[int, int]]:
    """``{path: (docstring lines, all lines)}`` for every module of ``package`` but ``_proto``."""
    counts: dict[Path, tuple[int, int]] = {}
    for path in sorted(package.rglob("*.py")):
        if any(part in SKIP for part in path.relative_to(package).parts):
            continue
        source = path.read_text(encoding="utf-8")
        counts[path] = (docstring_lines(source), len(source.splitlines()))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=float, metavar="PCT", help="exit 1 when the share is above PCT percent")
    parser.add_argument("--top", type=int, default=15, help="how many files to list (default 15)")
    args = parser.parse_args(argv)

    counts = measure()
    doc = sum(d for d, _ in counts.values())
    total = sum(n for _, n in counts.values())
    share = 100.0 * doc / total if total else 0.0
    print(f"docstrings: {doc} of {total} lines = {share:.1f} % ({len(counts)} files)")
    print(f"top {args.top} files by docstring lines:")
    ranked = sorted(counts.items(), key=lambda item: item[1][0], reverse=True)
    for path, (d, n) in ranked[:args.top]:
        print(f"  {d:5d} / {n:5d} ({100.0 * d / n if n else 0.0:4.1f} %)  {path.relative_to(ROOT)}")
    if args.max is not None and share > args.max:
        print(f"docstring share {share:.1f} % is above --max {args.max:g} %", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
