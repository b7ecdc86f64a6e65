"""``ts.handler_utils`` (TorchServe import path)."""
