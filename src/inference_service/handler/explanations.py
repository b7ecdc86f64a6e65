"""Explanations for the handlers: Captum (optional, ``pip install captum``) and the errors without it.

TorchServe's built-in handlers import Captum at load; here it is imported at the first explanation,
so that a default install loads and predicts without it. Errors are :class:`PredictionException`
with TorchServe's status semantics: 501 when the handler or the install cannot explain, 400 for a
``target`` that is not a class index.
"""

from __future__ import annotations

import importlib
from typing import Any

from inference_service.handler.util import PredictionException

NO_CAPTUM = ("explanations need Captum, which is not installed: install the 'explain' extra "
             "(scripts/install --explain, or pip install captum)")


def captum_attr(name: str) -> Any:
    """The class ``name`` of ``captum.attr``; PredictionException (501) when Captum is not installed."""
    try:
        module = importlib.import_module("captum.attr")
    except ImportError as exc:
        raise PredictionException(f"{NO_CAPTUM} ({exc})", 501) from exc
    return getattr(module, name)


def no_explanations(handler: object, why: str = "it defines neither explain_handle nor get_insights"
                    ) -> PredictionException:
    """The 501 of a handler that has no explanation to give (TorchServe's fails with 503, "Prediction failed")."""
    return PredictionException(f"{type(handler).__name__} gives no explanations: {why}", 501)


def request_target(row: Any) -> int:
    """A request's ``target`` input as an integer class index (0 without one), as TorchServe's
    ``explain_handle`` reads it; a form field's bytes or text are parsed. 400 if not an integer."""
    value = row.get("target") if isinstance(row, dict) else None
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", "replace")
    if value is None or value == "":
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().removeprefix("-").isdigit():
        return int(value)
    raise PredictionException(f"target must be an integer class index, got {str(value)[:50]!r}", 400)


def token_importances(model: Any, layer: Any, ids: Any, target: int) -> list[float]:
    """Layer Integrated Gradients of class ``target`` at ``layer`` for one text's token ids run as
    ``model(ids, offsets=[0])``, reference token 0 (TorchServe's ``TokenReferenceBase``): one
    score per token, divided by their L2 norm.

    An ``EmbeddingBag`` (sum or mean) outputs one vector per text: its attribution is split over the
    tokens by linearity, ``(embedding(token) - embedding(0)) . mean gradient``, which is Integrated
    Gradients over the token embeddings (TorchServe's returns the per-bag attribution).
    Raises PredictionException (501) without Captum or for a ``max`` bag.
    """
    import torch

    lig_class = captum_attr("LayerIntegratedGradients")
    reference = torch.zeros_like(ids)
    offsets = torch.zeros(1, dtype=torch.long, device=ids.device)
    if isinstance(layer, torch.nn.EmbeddingBag):
        if layer.mode not in ("sum", "mean"):
            raise PredictionException(f"explanations of an EmbeddingBag need mode sum or mean, not {layer.mode}", 501)
        gradient = lig_class(model, layer, multiply_by_inputs=False).attribute(
            ids, reference, additional_forward_args=(offsets,), target=target)
        rows = layer.weight[ids] - layer.weight[reference]
        scores = (rows @ gradient.reshape(-1)) / (len(ids) if layer.mode == "mean" else 1)
    else:
        attributions = lig_class(model, layer).attribute(ids, reference, additional_forward_args=(offsets,),
                                                         target=target)
        scores = attributions.sum(dim=-1).reshape(-1)
    norm = torch.linalg.vector_norm(scores)
    return (scores / norm if norm > 0 else scores).detach().cpu().tolist()
