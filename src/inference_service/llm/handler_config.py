"""The LLM handler's config beside the typed ``handler:`` section
(:class:`~inference_service.contracts.handler_config.HandlerConfig`): the top-level
``continuousBatching`` key, and the warning for retired keys.

See docs/llm.md, "Settings (model-config.yaml)".
"""

from __future__ import annotations

import logging

from inference_service.contracts.handler_config import HandlerConfig
from inference_service.handler import Context

log = logging.getLogger(__name__)

def continuous_batching(context: Context) -> bool:
    """Whether the model config asks for continuous batching (top-level ``continuousBatching``
    true, or the string ``"true"``, as TorchServe reads it)."""
    value = (getattr(context, "model_yaml_config", None) or {}).get("continuousBatching")
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return bool(value)


def warn_retired(config: HandlerConfig) -> None:
    """Log one warning per retired key in the ``handler:`` section (``quantization``, ``prepack``)."""
    for retired in config.retired:
        log.warning("handler config: %r is retired and has no effect (the OpenVINO engine's int8 weights "
                    "replace the torch engine's CPU modes; docs/llm.md, 'Engines')", retired)
