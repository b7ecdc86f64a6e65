"""``ts.context``: TorchServe's handler context, backed by inference-service."""

from inference_service.handler.context import Context, RequestProcessor

__all__ = ["Context", "RequestProcessor"]
