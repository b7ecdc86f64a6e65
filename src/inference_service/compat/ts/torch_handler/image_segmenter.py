"""``ts.torch_handler.image_segmenter``: ``--handler image_segmenter`` (``__handler__`` for the loader)."""

from inference_service.handler.vision_handlers import ImageSegmenter

__handler__ = ImageSegmenter

__all__ = ["ImageSegmenter"]
