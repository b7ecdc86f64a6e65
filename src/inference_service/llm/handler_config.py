"""The LLM handler's config beside the typed ``handler:`` section
(:class:`~inference_service.contracts.handler_config.HandlerConfig`): the top-level
``continuousBatching`` key, the warning for retired keys, and the ``chat_template`` a model is given.

See docs/llm.md, "Settings (model-config.yaml)".
"""

from __future__ import annotations

import logging
import os
from typing import Any

from inference_service.contracts.handler_config import HandlerConfig, HandlerConfigError, is_inline_template
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


def apply_chat_template(tokenizer: Any, config: HandlerConfig) -> str:
    """Give ``tokenizer`` the config's ``chat_template`` (a Jinja file, or the template itself), which
    replaces the model's own; what DescribeModel says of the template used.

    Raises:
        HandlerConfigError: the file cannot be read or is not UTF-8, or the template does not render a
            one-message chat (its own error).
    """
    value = config.chat_template
    if value is None:
        return "the model's own" if getattr(tokenizer, "chat_template", None) else \
            "none: chat is refused (set 'chat_template' in the handler config)"
    if is_inline_template(value):
        text, shown = value, "given in the handler config ('chat_template')"
    else:
        try:
            with open(os.path.expanduser(value), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise HandlerConfigError(f"'chat_template' {value}: cannot read it as UTF-8 text: {exc}",
                                     "chat_template") from None
        shown = f"{os.path.basename(value)} (handler config 'chat_template')"
    tokenizer.chat_template = text
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - Jinja's and the template's own errors, any kind
        raise HandlerConfigError(f"'chat_template' does not render a chat: {type(exc).__name__}: {exc}",
                                 "chat_template") from None
    return shown
