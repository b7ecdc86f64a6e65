"""``ts.torch_handler.text_classifier``: ``--handler text_classifier`` (``__handler__`` for the loader)."""

from inference_service.handler.text_handlers import TextClassifier

__handler__ = TextClassifier

__all__ = ["TextClassifier"]
