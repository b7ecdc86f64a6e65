"""YAML read from a model archive, within a budget: ``yaml.safe_load`` that cannot blow up.

YAML aliases let a few hundred bytes stand for millions of values ("billion laughs"), or
recurse. :func:`load_yaml_budgeted` uses PyYAML's pure-Python ``SafeLoader`` (libyaml's composer
crashes on deep nesting) and counts the nodes with aliases expanded while composing, stopping at
the first past the budget. Aliases within it still work (TorchServe's ``metrics.yaml`` uses them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from inference_service.errors import InvalidArgument

MAX_YAML_BYTES = 1024 * 1024
"""Largest YAML file read from an archive (1 MiB)."""
MAX_YAML_NODES = 100_000
"""Most nodes (scalars, sequences, mappings) one YAML document may have with its aliases expanded."""


class _BudgetLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` counting the nodes composed, an alias as the size of its anchored node;
    refuses past ``max_nodes`` and for an alias used inside the node it names."""

    def __init__(self, text: str, source: str, max_nodes: int) -> None:
        super().__init__(text)
        self.source = source
        self.max_nodes = max_nodes
        self.expanded = 0
        self.anchored_sizes: dict[str, int] = {}  # anchor -> expanded size, once its node is complete

    def _count(self, nodes: int) -> None:
        self.expanded += nodes
        if self.expanded > self.max_nodes:
            raise InvalidArgument(
                f"{self.source} expands to more than {self.max_nodes} YAML nodes once its aliases (*name) "
                "are expanded; refusing it (a model config never needs that many)")

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        """Compose one node as PyYAML does, counting it (see the class docstring)."""
        event = self.peek_event()
        anchor = event.anchor
        if isinstance(event, yaml.AliasEvent):
            if anchor in self.anchors:  # an unknown one is the composer's own error
                if anchor not in self.anchored_sizes:
                    raise InvalidArgument(f"{self.source}: the alias *{anchor} is used inside the node it names "
                                          "(a recursive structure); refusing it")
                self._count(self.anchored_sizes[anchor])
            node: yaml.Node = super().compose_node(parent, index)
            return node
        start = self.expanded
        node = super().compose_node(parent, index)
        self._count(1)
        if anchor is not None:
            self.anchored_sizes[anchor] = self.expanded - start
        return node


def load_yaml_budgeted(text: str, source: str, max_nodes: int = MAX_YAML_NODES) -> Any:
    """``yaml.safe_load(text)`` within ``max_nodes`` nodes with every alias expanded.

    Raises:
        InvalidArgument: starting with ``source``: too many nodes, an alias inside its own node,
            nesting too deep, or not valid YAML (including tags ``safe_load`` refuses).
    """
    loader = _BudgetLoader(text, source, max_nodes)
    try:
        return loader.get_single_data()
    except RecursionError as exc:
        raise InvalidArgument(f"{source} is nested too deeply to parse") from exc
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{source} is not valid YAML: {exc}") from exc
    finally:
        loader.dispose()


def read_yaml_budgeted(path: Path, source: str, max_nodes: int = MAX_YAML_NODES,
                       max_bytes: int = MAX_YAML_BYTES) -> Any:
    """:func:`load_yaml_budgeted` of the UTF-8 file at ``path``, reading at most one byte past
    ``max_bytes`` (1 MiB).

    Raises:
        InvalidArgument: larger than ``max_bytes``, not UTF-8, or refused by the loader.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fin:
        data = fin.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InvalidArgument(f"{source} is larger than the {max_bytes}-byte limit of a YAML file; refusing it")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{source} is not valid YAML: {exc}") from exc
    return load_yaml_budgeted(text, source, max_nodes)
