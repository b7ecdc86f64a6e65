"""``ts.utils.util``: the helpers TorchServe handlers import."""

from inference_service.handler.util import (
    PredictionException,
    list_classes_from_module,
    load_label_mapping,
    map_class_to_label,
)

__all__ = ["PredictionException", "list_classes_from_module", "load_label_mapping", "map_class_to_label"]
