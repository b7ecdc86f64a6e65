#!/usr/bin/env python3
"""Fail when the modules of ``src/inference_service`` import each other in a circle, or when
one room (a folder by role, see docs/architecture.md) imports a room it must not.

Every ``import`` / ``from ... import`` statement of a module counts, wherever it is: at
the top, inside a function, and under ``if TYPE_CHECKING:`` (a circle of type-only
imports is still two modules that each need the other to be read). Generated stubs
(``_proto``) are left out. An import names the module it loads: ``from pkg import
name`` is an edge to ``pkg.name`` when that is a module of ours, else to ``pkg``.
The implicit import of a package's ``__init__`` by its submodules does not count.

The rooms' one-way arrows are :data:`ALLOWED`: a room may import itself and the rooms listed
for it, nothing else (so nothing under ``worker/``, which runs in the worker process, imports
the server's ``dispatch/``, ``serving/`` or ``frontends/``).

Usage: ``.venv/bin/python scripts/check_imports.py [--graph]`` (``--graph`` also prints
every module's imports). Exit status 1 and one line per circle or forbidden arrow.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "inference_service"
SRC = ROOT / "src"
SKIP = ("_proto",)

# room -> the rooms it may import. A room is a folder of the package (``frontends/<door>`` each
# its own room) or a top-level module; ``pkg`` is the package's ``__init__`` (its version).
BASE = {"errors", "heap", "pkg"}
# ``contracts`` holds what crosses a process or a door: it imports only BASE, every room imports it
LOW = BASE | {"contracts"}
ALLOWED: dict[str, set[str]] = {
    "pkg": set(), "errors": set(), "heap": set(), "connection_limits": set(),
    "contracts": BASE,
    "archive": LOW,
    "config": LOW | {"archive", "connection_limits"},
    "security": LOW | {"config"},
    "handler": LOW,
    "compat": LOW | {"handler"},
    "llm": LOW | {"handler"},
    "embeddings": LOW | {"handler", "llm"},
    "rerank": LOW | {"handler", "llm", "embeddings"},
    "speech": LOW | {"handler", "llm"},
    "worker": LOW | {"handler"},
    "dispatch": LOW,
    "serving": LOW | {"archive", "config", "dispatch"},
    "observability": LOW | {"config", "connection_limits", "serving"},
    "frontends": LOW | {"serving", "dispatch"},
    "frontends.oip": LOW | {"frontends", "serving"},
    "frontends.openai": LOW | {"frontends", "serving"},
    "frontends.anthropic": LOW | {"frontends", "frontends.openai", "serving"},
    "frontends.grpc": LOW | {"frontends", "frontends.oip", "serving", "observability", "security", "config"},
    "frontends.http": LOW | {"frontends", "frontends.oip", "frontends.openai", "frontends.anthropic", "serving",
                             "observability", "security", "config", "connection_limits"},
    "launch": LOW | {"archive", "config", "observability", "security"},
    "server": LOW | {"archive", "config", "connection_limits", "security", "dispatch", "serving", "observability",
                     "frontends", "frontends.grpc", "frontends.http", "frontends.oip", "frontends.openai"},
    "cli": LOW | {"archive", "config", "security", "observability", "launch", "server"},
    "__main__": {"cli"},
}


def room(module: str) -> str:
    """``inference_service.frontends.grpc.base`` -> ``frontends.grpc``; ``inference_service.cli`` -> ``cli``."""
    parts = module.split(".")[1:]
    if not parts:
        return "pkg"
    if parts[0] == "frontends" and len(parts) > 2:
        return f"frontends.{parts[1]}"
    return parts[0]


def forbidden(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that crosses rooms against :data:`ALLOWED` (or from an unlisted room)."""
    out = []
    for name in sorted(graph):
        source = room(name)
        for target in sorted(graph[name]):
            dest = room(target)
            if dest == source:
                continue
            if source not in ALLOWED:
                out.append(f"room {source!r} ({name}) is not in ALLOWED: add it with its arrows")
                break
            if dest not in ALLOWED[source]:
                out.append(f"forbidden arrow {source} -> {dest}: {name} imports {target}")
    return out


def module_name(path: Path) -> str:
    """``src/inference_service/worker/main.py`` -> ``inference_service.worker.main``."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Our modules by dotted name (generated stubs left out)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        if any(part in SKIP for part in path.relative_to(SRC / PACKAGE).parts):
            continue
        out[module_name(path)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that module ``name`` imports (anywhere in it, ``TYPE_CHECKING`` included)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base_parts = name.split(".") if is_package else name.split(".")[:-1]
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` loads a.b.c; keep the longest prefix that is one of ours
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(1000, 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def path_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One circle through the component's first module, for the message (a -> b -> a)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(parents[chain[-1]])
                return [start, *reversed(chain[:-1]), start] if node != start else [start, start]
            if nxt not in parents:
                parents[nxt] = node
                queue.append(nxt)
    return component  # pragma: no cover - a component always has a circle


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="store_true", help="print every module's imports of ours")
    args = parser.parse_args()
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    if args.graph:
        for name in sorted(graph):
            print(f"{name}: {', '.join(sorted(graph[name])) or '-'}")
    found = cycles(graph)
    for component in found:
        print(f"import circle: {' -> '.join(path_in(component, graph))}  (modules: {', '.join(component)})")
    arrows = forbidden(graph)
    for line in arrows:
        print(line)
    if found or arrows:
        return 1
    print(f"no import circle among {len(graph)} modules; every arrow between rooms is allowed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
