"""``ts.torch_handler.text_handler``: TorchServe's ``TextHandler`` base, backed by inference-service."""

from inference_service.handler.text_handlers import TextHandler

__handler__ = TextHandler

__all__ = ["TextHandler"]
