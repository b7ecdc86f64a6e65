"""``ts.torch_handler`` (TorchServe import path)."""
