"""``ts.protocol`` (TorchServe import path)."""
