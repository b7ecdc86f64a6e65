"""``ts.torch_handler.image_classifier``: ``--handler image_classifier`` (``__handler__`` for the loader)."""

from inference_service.handler.vision_handlers import ImageClassifier

__handler__ = ImageClassifier

__all__ = ["ImageClassifier"]
