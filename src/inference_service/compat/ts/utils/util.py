"""``ts.utils.util``: the helpers TorchServe handlers import."""

from inference_service.handler.util import (
    PredictionException,
    get_yaml_config,
    list_classes_from_module,
    load_label_mapping,
    map_class_to_label,
)

__all__ = [
    "PredictionException",
    "get_yaml_config",
    "list_classes_from_module",
    "load_label_mapping",
    "map_class_to_label",
]
