"""``ts.torch_handler.image_classifier``: the built-in ``image_classifier`` handler.

``--handler image_classifier`` resolves here; ``__handler__`` names the class for
the worker's loader. See :class:`inference_service.handler.vision_handlers.ImageClassifier`.
"""

from inference_service.handler.vision_handlers import ImageClassifier

__handler__ = ImageClassifier

__all__ = ["ImageClassifier"]
