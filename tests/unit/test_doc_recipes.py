"""The recipes of docs/development.md name files that exist.

A recipe lists the files to touch for a change (a sampling parameter, a metric, a front door). A
file that is renamed or moved would leave the recipe pointing nowhere: every file name of the
"Recipes" section, written in a code span (`` `frontends/http/inference.py` ``) or as a docs path
(``docs/llm.md``), must exist under the repository root or under ``src/inference_service/``.
Names with a placeholder (``<door>``) are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILE = re.compile(r"`([\w./-]+\.(?:py|json|md|yml|yaml|proto))`|\b(docs/[\w.-]+\.md)\b")


def test_recipes_name_existing_files():
    recipes = (ROOT / "docs" / "development.md").read_text().split("## Recipes", 1)[1]
    names = {m[1] or m[2] for m in FILE.finditer(recipes)}
    assert len(names) > 10, "the Recipes section names fewer files than expected: has its heading changed?"
    bases = (ROOT, ROOT / "src" / "inference_service")
    missing = sorted(n for n in names if not any((base / n).is_file() for base in bases))
    assert missing == [], f"docs/development.md's recipes name files that do not exist: {missing}"
