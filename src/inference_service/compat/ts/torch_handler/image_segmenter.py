"""``ts.torch_handler.image_segmenter``: the built-in ``image_segmenter`` handler.

``--handler image_segmenter`` resolves here; ``__handler__`` names the class for
the worker's loader. See :class:`inference_service.handler.vision_handlers.ImageSegmenter`.
"""

from inference_service.handler.vision_handlers import ImageSegmenter

__handler__ = ImageSegmenter

__all__ = ["ImageSegmenter"]
