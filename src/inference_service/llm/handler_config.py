"""The LLM handler's config: the top-level ``continuousBatching`` key and the keys of the
``handler:`` section the handler reads itself (the engine's are read by
:mod:`inference_service.llm.engines`, the generation defaults by
:func:`~inference_service.llm.requests.params_from_config`).

See docs/llm.md, "Settings (model-config.yaml)".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from inference_service.handler import Context

log = logging.getLogger(__name__)

#: Newly arrived requests prefilled per engine step by default: a burst of 8 gets its first
#: tokens about twice as early at the median than with all 8 prefilled in one step, at the same
#: throughput (benchmarks/README.md, "LLM concurrency").
DEFAULT_MAX_PREFILL = 2
#: Tokens per continuous-batching step by default (vLLM's ``max_num_batched_tokens``): one per
#: decoding request plus prompt-chunk tokens; chosen by measurement (benchmarks/RESULTS.md,
#: "Issue 25: scheduler").
DEFAULT_MAX_NUM_BATCHED_TOKENS = 64
#: Handler config keys of the torch engine's retired CPU modes (dynamic int8, oneDNN prepacking):
#: accepted with a warning, so archives built before keep loading.
RETIRED_KEYS = frozenset({"quantization", "prepack"})


def continuous_batching(context: Context) -> bool:
    """Whether the model config asks for continuous batching (top-level ``continuousBatching``
    true, or the string ``"true"``, as TorchServe reads it)."""
    value = (getattr(context, "model_yaml_config", None) or {}).get("continuousBatching")
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return bool(value)


def warn_retired(config: Mapping[str, Any]) -> None:
    """Log one warning per retired key in the ``handler:`` section (:data:`RETIRED_KEYS`)."""
    for retired in sorted(RETIRED_KEYS & set(config)):
        log.warning("handler config: %r is retired and has no effect (the OpenVINO engine's int8 weights "
                    "replace the torch engine's CPU modes; docs/llm.md, 'Engines')", retired)
