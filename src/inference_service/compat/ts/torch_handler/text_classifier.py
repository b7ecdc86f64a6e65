"""``ts.torch_handler.text_classifier``: the built-in ``text_classifier`` handler.

``--handler text_classifier`` resolves here; ``__handler__`` names the class for
the worker's loader. See :class:`inference_service.handler.text_handlers.TextClassifier`.
"""

from inference_service.handler.text_handlers import TextClassifier

__handler__ = TextClassifier

__all__ = ["TextClassifier"]
