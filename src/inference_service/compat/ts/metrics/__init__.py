"""``ts.metrics`` (TorchServe import path): dimensions and metric types for ``context.metrics``."""
