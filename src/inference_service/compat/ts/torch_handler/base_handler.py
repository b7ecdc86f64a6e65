"""``ts.torch_handler.base_handler``: TorchServe's ``BaseHandler`` (``__handler__``: defined elsewhere)."""

from inference_service.handler.base_handler import BaseHandler

__handler__ = BaseHandler

__all__ = ["BaseHandler"]
