"""Helpers TorchServe handlers use (``ts.utils.util``), written for inference-service."""

from __future__ import annotations

import inspect
import json
import os
from types import ModuleType
from typing import Any


class PredictionException(Exception):
    """Raised by a handler to fail the batch with an HTTP status, as in TorchServe.

    The worker maps ``error_code`` through TorchServe's table to a gRPC code
    (e.g. 400 -> INVALID_ARGUMENT, 507 -> RESOURCE_EXHAUSTED) with ``message``.

    Args:
        message: the error text sent to the client.
        error_code: HTTP status (default 500).
    """

    def __init__(self, message: str, error_code: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.error_code = error_code

    def __str__(self) -> str:
        return f"{self.message} : {self.error_code}"


def list_classes_from_module(module: ModuleType, parent_class: type | None = None) -> list[type]:
    """Classes defined in ``module`` itself (optionally only subclasses of ``parent_class``)."""
    classes = [
        obj for _, obj in inspect.getmembers(module, inspect.isclass) if obj.__module__ == module.__name__
    ]
    if parent_class is not None:
        classes = [c for c in classes if issubclass(c, parent_class)]
    return classes


def load_label_mapping(mapping_file_path: str) -> dict[str, Any] | None:
    """Read ``index_to_name.json``: ``{"0": "label", ...}`` (values may be ``[id, label]`` lists).

    Returns:
        The mapping, or ``None`` when the file does not exist.

    Raises:
        ValueError: the file is not a JSON object.
    """
    if not os.path.isfile(mapping_file_path):
        return None
    with open(mapping_file_path, encoding="utf-8") as f:
        mapping = json.load(f)
    if not isinstance(mapping, dict):
        raise ValueError(f"{mapping_file_path}: the label mapping must be a JSON object")
    return mapping


def map_class_to_label(
    probs: list[list[float]], mapping: dict[str, Any] | None = None, lbl_classes: list[list[Any]] | None = None
) -> list[dict[str, float]]:
    """Pair each row of ``probs`` with its class labels: ``[{label: prob, ...}, ...]``.

    Args:
        probs: per request, the top-k probabilities.
        mapping: ``index_to_name`` mapping (class index as a string -> label).
        lbl_classes: per request, the class indices of ``probs`` (default 0..k-1).
    """
    if lbl_classes is None:
        lbl_classes = [list(range(len(row))) for row in probs]
    results = []
    for row_probs, row_classes in zip(probs, lbl_classes, strict=False):
        entry: dict[str, float] = {}
        for cls, prob in zip(row_classes, row_probs, strict=False):
            label: Any = cls
            if mapping is not None:
                label = mapping.get(str(cls), cls)
                if isinstance(label, list):
                    label = label[-1]
            entry[str(label)] = prob
        results.append(entry)
    return results
