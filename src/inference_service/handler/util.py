"""Helpers TorchServe handlers use (``ts.utils.util``), written for inference-service."""

from __future__ import annotations

import inspect
import json
import os
from types import ModuleType
from typing import Any


class PredictionException(Exception):
    """Raised by a handler to fail the batch with HTTP status ``error_code`` (500), as in TorchServe;
    mapped through TorchServe's table (400 -> INVALID_ARGUMENT, 409 -> ABORTED, 507 -> INTERNAL)."""

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


def load_label_mapping(mapping_file_path: str) -> dict[str, str] | None:
    """``index_to_name.json`` as ``{"<class index>": "label"}``, or ``None`` without the file; also
    ImageNet's ``["n01440764", "tench"]`` values and ``{"object_type_names": [...]}``, as TorchServe.

    Raises:
        ValueError: not JSON, not an object, or a label not a string (names the file).
    """
    if not os.path.isfile(mapping_file_path):
        return None
    try:
        with open(mapping_file_path, encoding="utf-8") as f:
            mapping = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{mapping_file_path}: cannot read the label mapping: {exc}") from exc
    if not isinstance(mapping, dict):
        raise ValueError(f'{mapping_file_path}: the label mapping must be a JSON object {{"0": "label", ...}}')
    names = mapping.get("object_type_names")
    if isinstance(names, list):
        return {str(i): str(name) for i, name in enumerate(names)}
    result: dict[str, str] = {}
    for key, value in mapping.items():
        label = value[-1] if isinstance(value, list) and value else value
        if not isinstance(label, str):
            raise ValueError(
                f"{mapping_file_path}: label of class {key!r} must be a string or a list ending in one, "
                f"got {value!r}"
            )
        result[str(key)] = label
    return result


def get_yaml_config(yaml_file_path: str) -> dict[str, Any]:
    """``yaml.safe_load`` of a file (``{}`` if empty); TorchServe's ``ts.utils.util.get_yaml_config``."""
    import yaml

    with open(yaml_file_path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def map_class_to_label(
    probs: list[list[Any]], mapping: dict[str, Any] | None = None, lbl_classes: list[list[Any]] | None = None
) -> list[dict[str, Any]]:
    """Pair each row of ``probs`` with labels, ``[{label: value}, ...]``, as TorchServe's, except that
    a class missing from ``mapping`` keeps ``str(class)`` instead of raising.

    Raises:
        TypeError: ``probs`` is not a list (convert tensors with ``tolist()`` first).
    """
    if not isinstance(probs, list):
        raise TypeError(f"map_class_to_label needs a list of rows, got {type(probs).__name__} (use tolist())")
    if lbl_classes is None:
        lbl_classes = [list(range(len(row))) for row in probs]
    results = []
    for row_probs, row_classes in zip(probs, lbl_classes, strict=False):
        entry: dict[str, Any] = {}
        for cls, prob in zip(row_classes, row_probs, strict=False):
            label: Any = cls
            if mapping is not None:
                label = mapping.get(str(cls), cls)
                if isinstance(label, list):
                    label = label[-1]
            entry[str(label)] = prob
        results.append(entry)
    return results
