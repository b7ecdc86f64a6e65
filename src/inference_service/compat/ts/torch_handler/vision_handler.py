"""``ts.torch_handler.vision_handler``: TorchServe's ``VisionHandler`` base, backed by inference-service."""

from inference_service.handler.vision_handlers import VisionHandler

__handler__ = VisionHandler

__all__ = ["VisionHandler"]
