"""``ts.torch_handler.object_detector``: ``--handler object_detector`` (``__handler__`` for the loader)."""

from inference_service.handler.vision_handlers import ObjectDetector

__handler__ = ObjectDetector

__all__ = ["ObjectDetector"]
