"""The ``handler:`` section of model-config.yaml, typed: every key the server, the worker and the
bundled handlers read, declared once with its check.

:meth:`HandlerConfig.parse` is what registration runs (a bad value is refused before any worker
starts) and what the worker and the LLM handler read; keys it does not declare are kept in
``extra`` for custom handlers, as TorchServe passes the section through. The generation defaults
(``max_new_tokens``, ``temperature``, ``top_p``) are :class:`~.sampling.GenerationParams`' own.
See docs/llm.md, "Settings (model-config.yaml)".
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from inference_service.contracts.cpu import DEFAULT_SPIN_COUNT, WAIT_POLICIES, parse_affinity
from inference_service.contracts.sampling import (
    CONFIG_FIELDS,
    GenerationParams,
    InvalidRequest,
    params_from_config,
)

#: The LLM engines a handler config may name (docs/llm.md, "Engines").
ENGINES = ("openvino", "torch", "vllm", "llamacpp")
#: The OpenVINO engine's weight formats; ``auto`` (as absent): the default of the CPU's row
#: (``inference_service.llm.cpu_defaults``).
WEIGHT_FORMATS = ("auto", "fp32", "int8", "int4")
#: The highest value of a count (a larger budget only allocates more).
COUNT_MAX = 1_000_000
#: The longest ``chat_template`` value (characters), a path or a template.
MAX_CHAT_TEMPLATE_CHARS = 1 << 20
#: Keys of the torch engine's retired CPU modes: accepted with a warning, no effect.
RETIRED_KEYS = frozenset({"quantization", "prepack"})


class HandlerConfigError(ValueError):
    """A ``handler:`` value is invalid; ``key`` names it (the message quotes at most 60 characters)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(f"handler config: {message}")
        self.key = key


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _count(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= COUNT_MAX:
        raise HandlerConfigError(f"'{key}' must be an integer from 1 to {COUNT_MAX}, got {_shown(value)}", key)
    return value


def _spins(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HandlerConfigError(f"'{key}' must be a non-negative integer, got {_shown(value)}", key)
    return value


def _one_of(*choices: str) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in choices:
            raise HandlerConfigError(f"'{key}' must be one of {', '.join(choices)}, got {_shown(value)}", key)
        return value.lower()
    return check


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise HandlerConfigError(f"'{key}' must be true or false, got {_shown(value)}", key)
    return value


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise HandlerConfigError(f"'{key}' must be a non-empty string, got {_shown(value)}", key)
    return value


def _chat_template(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_CHAT_TEMPLATE_CHARS:
        raise HandlerConfigError(f"'{key}' must be a Jinja file's path or a template of at most "
                                 f"{MAX_CHAT_TEMPLATE_CHARS} characters, got {_shown(value)}", key)
    return value


def is_inline_template(value: str) -> bool:
    """Whether a ``chat_template`` value is the template itself (it holds Jinja's ``{{`` or ``{%``, as
    vLLM tells them apart), not a file's path."""
    return "{{" in value or "{%" in value


def _vllm_engine_config(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and k for k in value):
        raise HandlerConfigError(f"'{key}' must be a mapping of the engine's own argument names to values, "
                                 f"got {_shown(value)}", key)
    for name, item in value.items():
        if not isinstance(item, (str, int, float, bool)):
            raise HandlerConfigError(f"'{key}.{name}' must be a string, number or boolean, got {_shown(item)}", key)
    return MappingProxyType(dict(value))


def _affinity(key: str, value: Any) -> Any:
    try:
        parse_affinity(value)
    except ValueError as exc:
        raise HandlerConfigError(str(exc).removeprefix("handler config: "), key) from None
    return value


def setting(default: Any, check: Callable[[str, Any], Any]) -> Any:
    """Declare a key: its default (its value when absent or null) and its check
    (``check(key, value)`` returns the value to keep or raises :class:`HandlerConfigError`)."""
    return field(default=default, metadata={"check": check})


@dataclass(frozen=True)
class HandlerConfig:
    """The declared keys (docs/llm.md and docs/configuration.md give their meaning), the generation
    defaults, and ``extra``: every other key, as written."""

    # the worker's CPU use (every handler)
    torch_threads: int | None = setting(None, _count)
    omp_wait_policy: str | None = setting(None, _one_of(*WAIT_POLICIES))
    omp_spin_count: int = setting(DEFAULT_SPIN_COUNT, _spins)
    cpu_affinity: Any = setting(None, _affinity)  # a list of CPUs or "0-3,6", as written
    # the LLM engine (the bundled LLM handler)
    engine: str | None = setting(None, _one_of(*ENGINES))
    weight_format: str | None = setting(None, _one_of(*WEIGHT_FORMATS))
    model_path: str | None = setting(None, _text)
    gguf_file: str | None = setting(None, _text)
    # a Jinja chat template file (relative: inside the archive), or the template itself (vLLM's --chat-template)
    chat_template: str | None = setting(None, _chat_template)
    cache_dir: str | None = setting(None, _text)
    cache_size: int | None = setting(None, _count)  # GB of KV cache (OpenVINO engine)
    ir_cache_limit_gb: int | None = setting(None, _count)  # the OpenVINO IR cache's size before eviction
    max_num_batched_tokens: int | None = setting(None, _count)  # None: the engine's own default
    max_prefill_requests: int | None = setting(None, _count)
    enable_prefix_caching: bool = setting(True, _flag)
    # what one structured output may cost before it reaches the step (llm/grammar_check.py)
    structured_outputs_budget_ms: int = setting(5000, _count)  # CPU ms: compile and first tokens' masks
    structured_outputs_token_budget_ms: int = setting(50, _count)  # CPU ms of one token's mask
    structured_outputs_max_mb: int = setting(16, _count)  # its compiled form
    # vLLM's EngineArgs by their names (TorchServe's vLLM handler's key)
    vllm_engine_config: Mapping[str, Any] | None = setting(None, _vllm_engine_config)
    python: str | None = setting(None, _text)  # the interpreter of the model's workers (engine: vllm)
    generation: GenerationParams = GenerationParams()
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def parse(cls, section: Any) -> HandlerConfig:
        """The typed config of a ``handler:`` section (``None``: all defaults).

        Raises:
            HandlerConfigError: not a mapping, or a declared key with a bad value (names it).
        """
        if section is None:
            return cls()
        if not isinstance(section, Mapping):
            raise HandlerConfigError("the section must be a mapping of keys to values", "handler")
        values: dict[str, Any] = {}
        declared = {f.name for f in fields(cls) if "check" in f.metadata}
        for f in fields(cls):
            if "check" in f.metadata and section.get(f.name) is not None:
                values[f.name] = f.metadata["check"](f.name, section[f.name])
        try:
            values["generation"] = params_from_config(section)
        except InvalidRequest as exc:
            raise HandlerConfigError(str(exc).removeprefix("handler config: "), exc.field or "handler") from None
        values["extra"] = MappingProxyType({k: v for k, v in section.items()
                                            if k not in declared and k not in CONFIG_FIELDS})
        return cls(**values)

    def within(self, model_dir: str) -> HandlerConfig:
        """This config with a relative ``model_path``, ``gguf_file`` or ``chat_template`` file taken from
        ``model_dir`` (where the server extracted the archive: a self-contained archive names its own
        files so)."""
        def inside(path: str | None) -> str | None:
            if not path or not model_dir or os.path.isabs(os.path.expanduser(path)):
                return path
            return os.path.join(model_dir, path)
        template = self.chat_template
        if template is not None and not is_inline_template(template):
            template = inside(template)
        return replace(self, model_path=inside(self.model_path), gguf_file=inside(self.gguf_file),
                       chat_template=template)

    def with_threads(self, threads: int) -> HandlerConfig:
        """This config with ``torch_threads`` as the worker applied it (capped to its CPUs)."""
        return replace(self, torch_threads=threads)

    @property
    def retired(self) -> list[str]:
        """The retired keys it sets (:data:`RETIRED_KEYS`), sorted."""
        return sorted(RETIRED_KEYS & set(self.extra))
