"""inference-service: a gRPC-first model server, wire-compatible with TorchServe. See docs/index.md."""

__version__ = "0.1.0"
