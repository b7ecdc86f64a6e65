"""Every file or module name in a docstring or doc page exists in the repository.

Names go stale when code moves (issue 32: ``openai_mount.py`` and ``worker/process.py``
lived on in docstrings after the move to ``frontends/openai/mount.py`` and
``dispatch/process.py``). Scanned: the docstrings of ``src/inference_service`` (not the
generated ``_proto``), ``docs/**/*.md`` and ``README.md``. Checked: ``something.py`` and
``room/module.py`` paths (some repository file under :data:`ROOTS` must end with it); dotted
``inference_service.x.y`` paths, and ``room.x.y`` ones in double backticks relative to the
package (the longest prefix that is a module or package must be followed by names that module
defines); and ``docs/page.md`` links.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "inference_service"
ROOTS = ("src/inference_service", "scripts", "tests", "benchmarks", "examples", "clients")

FILE_NAME = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_]\w*\.py)\b")
# A path relative to the package, in double backticks: ``dispatch.process.WorkerProcess``.
RELATIVE_PATH = re.compile(
    r"``((?:archive|contracts|dispatch|errors|frontends|launch|llm|observability|security|serving|worker)"
    r"(?:\.[A-Za-z_]\w*)+)``")
DOC_PAGE = re.compile(r"(?<![\w./-])docs/[\w./-]+\.md\b")
MODULE_PATH = re.compile(r"(?<![\w.])inference_service(?:\.[A-Za-z_]\w*)+")

# Names that are deliberately not ours; keep this short.
FOREIGN = {
    "file.py",  # placeholder in the handler entry-point grammar ("file.py:function")
    "my_handler.py",  # written by docs/own-model.md's own example
    "v2_double.py",  # written by docs/open-inference-protocol.md's own example
    "kserve_handler.py",  # written by docs/scaling-out.md's own example
    "ts-setup/scaler2_handler.py",  # written by docs/migrating-from-torchserve.md's own example
    "ts_scripts/torchserve_grpc_client.py",  # TorchServe's repository, the client we replace
    "docs/management_api.md",  # TorchServe's docs page, cited
    "docs/request_envelopes.md",  # TorchServe's docs page, cited
}
FOREIGN_PREFIXES = (
    "ts/",  # TorchServe's Python backend, cited as the source of a behaviour
)
# Logger names (docs/observability.md) and the instance's pid file, not modules.
NOT_MODULES = {
    "inference_service.access",
    "inference_service.log",
    "inference_service.metrics",
    "inference_service.model_metrics",
    "inference_service.worker.smollm2",  # the logger inference_service.worker.<model> of one model
    "inference_service.pid",
}

# Stale names inside files another change owns; remove an entry once its file is fixed.
KNOWN_PENDING: set[tuple[str, str]] = set()


def _texts() -> list[tuple[str, str]]:
    texts = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    texts.append((str(path.relative_to(REPO)), doc))
    for path in [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]:
        texts.append((str(path.relative_to(REPO)), path.read_text(encoding="utf-8")))
    return texts


@cache
def _repo_files() -> tuple[str, ...]:
    files: list[str] = []
    for root in ROOTS:
        files += ["/" + str(p.relative_to(REPO)) for p in (REPO / root).rglob("*.py")]
    return tuple(files)


def _file_exists(name: str) -> bool:
    if name in FOREIGN or name.startswith(FOREIGN_PREFIXES):
        return True
    return any(f.endswith("/" + name) for f in _repo_files())


@cache
def _defined_names(module_file: Path) -> dict[str, set[str]]:
    """Top-level names of a module, each with the names its class body defines."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(module_file.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            members = set()
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        members.update(t.id for t in item.targets if isinstance(t, ast.Name))
            names[node.name] = members
        elif isinstance(node, ast.Assign):
            names.update((t.id, set()) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(((a.asname or a.name).split(".")[0], set()) for a in node.names)
    return names


def _module_exists(dotted: str) -> bool:
    if dotted in NOT_MODULES:
        return True
    parts = dotted.split(".")
    path = PACKAGE.parent
    module_file: Path | None = None
    rest: list[str] = []
    for i, part in enumerate(parts):
        if (path / part).is_dir() and (path / part / "__init__.py").exists():
            path = path / part
            module_file = path / "__init__.py"
        elif (path / f"{part}.py").exists():
            module_file = path / f"{part}.py"
            rest = parts[i + 1:]
            break
        else:
            rest = parts[i:]
            break
    if module_file is None:
        return False
    if not rest:
        return True
    defined = _defined_names(module_file)
    if rest[0] not in defined:
        return False
    return len(rest) == 1 or rest[1] in defined[rest[0]] or not defined[rest[0]]


def _stale_names() -> set[tuple[str, str]]:
    stale = set()
    for where, text in _texts():
        stale.update((where, name) for name in FILE_NAME.findall(text) if not _file_exists(name))
        stale.update((where, name) for name in MODULE_PATH.findall(text) if not _module_exists(name))
        stale.update((where, name) for name in RELATIVE_PATH.findall(text)
                     if not _module_exists("inference_service." + name))
        stale.update((where, name) for name in DOC_PAGE.findall(text)
                     if name not in FOREIGN and not (REPO / name).is_file())
    return stale


def test_no_stale_names_in_docstrings_or_docs() -> None:
    stale = _stale_names() - KNOWN_PENDING
    assert not stale, "names that do not exist in the repository:\n" + "\n".join(
        f"  {where}: {name}" for where, name in sorted(stale))


def test_known_pending_entries_are_still_stale() -> None:
    fixed = KNOWN_PENDING - _stale_names()
    assert not fixed, f"fixed now, remove from KNOWN_PENDING: {sorted(fixed)}"


@pytest.mark.parametrize(("name", "exists"), [
    ("dispatch/process.py", True),
    ("worker/process.py", False),
    ("openai_mount.py", False),
    ("ts/async_service.py", True),
])
def test_file_names_are_checked(name: str, exists: bool) -> None:
    assert _file_exists(name) is exists


@pytest.mark.parametrize(("name", "exists"), [
    ("inference_service.dispatch.jobs", True),
    ("inference_service.archive.fetch.UrlPolicy", True),
    ("inference_service.worker.process", False),
    ("inference_service.worker.channel.POLL_INTERVAL_S", True),
    ("inference_service.serving.core.NoSuchThing", False),
    ("inference_service.nosuchmodule", False),
])
def test_module_paths_are_checked(name: str, exists: bool) -> None:
    assert _module_exists(name) is exists
