"""``ts.torch_handler.object_detector``: the built-in ``object_detector`` handler.

``--handler object_detector`` resolves here; ``__handler__`` names the class for
the worker's loader. See :class:`inference_service.handler.vision_handlers.ObjectDetector`.
"""

from inference_service.handler.vision_handlers import ObjectDetector

__handler__ = ObjectDetector

__all__ = ["ObjectDetector"]
