"""Model-level transformations of a loaded causal LM for faster CPU decoding.

The decode step of a small LM is almost all matrix-vector products over the linear layers'
weights (81 % ``aten::mm`` for SmolLM2-135M), so its speed is how fast those weights stream
from memory. Two transformations, chosen per model by the handler config
(:func:`optimize_model`):

- ``prepack`` (no quantization): each ``nn.Linear`` becomes a :class:`PackedLinear` holding
  its weight reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
  the layout inductor's ``freezing`` uses), run by ``torch.ops.mkldnn._linear_pointwise``.
  Same fp32 arithmetic in another order: greedy tokens equal eager fp32 on the committed
  prompts (tests/e2e/test_llm_quality.py). CPU only; the LM head tied to the embedding gets
  its own packed copy (SmolLM2-135M: +113 MB).
- ``quantization: int8``: dynamic int8 (FBGEMM) with per-output-channel weight scales and
  full-range activations, of the attention and gate/up projections of every decoder layer
  but the first and the last. Kept fp32 (prepacked), by measurement on SmolLM2-135M
  (perplexity on the committed text, fp32 37.35): the MLP down projection, whose input
  (``act(gate) * up``) has outlier channels (int8 there alone: 56.8), the first and last
  layers, and the LM head (int8 everywhere: 114; without down projection: 38.9, +4.2 %;
  also without the first and last layers: 37.8, +1.2 %). SmoothQuant-style scaling of the
  down projection (alpha 0.5, folded into the up projection) still gave 43.7.

torch is imported at module level: import this module only where torch is available.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Accepted ``quantization`` values of the handler config.
QUANTIZATION_MODES = ("none", "int8")


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` with its weight prepacked for oneDNN (CPU, fp32).

    Input ``[..., in_features]``, output ``[..., out_features]``; the packed weight replaces
    the original (the module keeps no ``weight`` parameter).
    """

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 1) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint))
        self.bias: torch.Tensor | None = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(torch.nn.Module):
    """``nn.Linear`` as dynamic int8 (FBGEMM): weights quantized once per output channel,
    activations per tensor at every call over the full 8-bit range."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def _replace_linears(model: torch.nn.Module, make: Any, skip: set[str]) -> int:
    """Replace every ``nn.Linear`` child not named in ``skip`` by ``make(linear)``; the count."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and name not in skip:
                setattr(module, name, make(child))
                count += 1
    return count


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's list of decoder layers (``model.model.layers`` in transformers' decoder LMs)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h"):
            return module
    return None


#: Linear layers that int8 leaves in fp32, by attribute name.
INT8_KEEP_FP32 = {"lm_head", "down_proj"}


def optimize_model(model: Any, quantization: str = "none", prepack: bool = True) -> Any:
    """Apply the handler config's ``quantization`` and ``prepack`` to ``model``, in place.

    Args:
        model: a loaded causal LM in eval mode.
        quantization: ``"none"`` or ``"int8"`` (:data:`QUANTIZATION_MODES`).
        prepack: prepack the remaining fp32 linear layers for oneDNN (CPU only; ignored,
            with a log line, on other devices or where torch lacks oneDNN).

    Returns:
        ``model`` (the same object).

    Raises:
        ValueError: an unknown ``quantization``, ``int8`` on a device other than CPU or on a
            model without a list of decoder layers (``layers`` / ``h``). A model of 2 layers
            or fewer has no layer to quantize and stays fp32.
    """
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"handler config: 'quantization' must be one of {QUANTIZATION_MODES}, got {quantization!r}")
    device = next(model.parameters()).device
    if quantization == "int8":
        if device.type != "cpu":
            raise ValueError(f"handler config: quantization 'int8' runs on CPU only, the model is on {device}")
        layers = _decoder_layers(model)
        if layers is None:
            raise ValueError("handler config: quantization 'int8' needs a decoder LM with a list of layers")
        count = sum(_replace_linears(layer, Int8Linear, INT8_KEEP_FP32) for layer in list(layers)[1:-1])
        log.info("quantization int8: %d linear layers dynamic int8 (down projections, first and last "
                 "layers and the LM head fp32)", count)
    if prepack:
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            log.info("prepack skipped: needs CPU with oneDNN (model on %s)", device)
        else:
            count = _replace_linears(model, PackedLinear, set())
            log.info("prepacked %d linear layers for oneDNN", count)
    if device.type == "cpu" and (quantization != "none" or prepack):
        _release_file_mapping(model)
    return model


def _release_file_mapping(model: torch.nn.Module) -> None:
    """Copy the parameters left after the transformation into memory of their own.

    transformers loads safetensors weights as views of one memory-mapped file; the replaced
    linear layers' pages were read (resident) while packing, and one remaining view (the
    embedding, a norm) keeps the whole mapping alive. Copying the few remaining parameters
    unmaps the file: measured on SmolLM2-135M int8, 1243 -> 838 MB of worker RSS.
    """
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
