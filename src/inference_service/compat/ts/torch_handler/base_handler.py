"""``ts.torch_handler.base_handler``: TorchServe's ``BaseHandler``, backed by inference-service."""

from inference_service.handler.base_handler import BaseHandler

__all__ = ["BaseHandler"]
