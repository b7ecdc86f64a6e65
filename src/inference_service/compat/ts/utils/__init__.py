"""``ts.utils`` (TorchServe import path)."""
