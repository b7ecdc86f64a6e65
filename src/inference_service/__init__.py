"""inference-service: a gRPC-first model server, wire-compatible with TorchServe.

The server (``inference_service.server``) exposes TorchServe's gRPC inference
and management APIs; models run in worker processes
(``inference_service.worker``) that load TorchServe-style handlers
(``inference_service.handler``).
"""

__version__ = "0.1.0"
