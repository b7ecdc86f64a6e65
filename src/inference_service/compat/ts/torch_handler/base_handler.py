"""``ts.torch_handler.base_handler``: TorchServe's ``BaseHandler``, backed by inference-service.

``--handler base_handler`` serves it directly (``__handler__`` names the class
for the worker's loader, since it is defined in another module).
"""

from inference_service.handler.base_handler import BaseHandler

__handler__ = BaseHandler

__all__ = ["BaseHandler"]
