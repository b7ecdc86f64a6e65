"""Import shims: TorchServe's ``ts`` package paths, backed by inference-service.

Workers put this directory first on ``sys.path`` so unmodified TorchServe
handlers (``from ts.torch_handler.base_handler import BaseHandler`` ...) run
against this server's implementation.
"""
