"""Model archives of the Open Inference Protocol tests (``test_open_inference.py``, ``test_tritonclient.py``).

- ``oip_echo``: ``handlers/oip_echo_handler.py``, a module-level handle that echoes tensors,
  upper-cases base64 BYTES and can show the JSON body it got;
- ``oip_doubler``: ``handlers/oip_doubler_handler.py``, a BaseHandler running the Doubler (a torch
  Linear layer, y = 2x) on FP32 [N, 2] with weights saved here;
- ``oip_kservev2``: the same model behind TorchServe's ``kservev2`` envelope
  (``handlers/oip_kservev2_handler.py``).
"""

from __future__ import annotations

from pathlib import Path

from conftest import build_mar, doubler_weights

_DOUBLER_HANDLERS = {"oip_doubler": "oip_doubler_handler.py", "oip_kservev2": "oip_kservev2_handler.py"}


def build_models(store: Path, names: tuple[str, ...]) -> list[str]:
    """Archive the named models (see the module docstring) into ``store``; returns ``name=url`` for ``--models``."""
    weights = doubler_weights(store / "doubler.pt") if set(names) & set(_DOUBLER_HANDLERS) else None
    for name in names:
        if name == "oip_echo":
            build_mar(store, name, "oip_echo_handler.py")
        else:
            build_mar(store, name, _DOUBLER_HANDLERS[name], serialized=str(weights), model_file="doubler_model.py")
    if weights is not None:
        weights.unlink()
    return [f"{name}={name}.mar" for name in names]
