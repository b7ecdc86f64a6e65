"""The one interface of the LLM engines (vLLM's ``EngineCoreClient``, OpenVINO GenAI's
``IContinuousBatchingPipeline``): :class:`Engine`, its step output :class:`StepOutput`, and the
:class:`EngineCapabilities` each engine declares beside its class.

The handler, the worker and the front doors see only this interface; which engine runs is the
builder's choice (:mod:`inference_service.llm.engines`). A request an engine cannot honour is
refused by :func:`refusal` from the declarations (a 400 naming the field and the engines that have
it), and docs/llm.md's field table is :func:`capability_table` (a test holds them equal).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Protocol

from inference_service.contracts.sampling import PARAM_FIELDS, GenerationParams
from inference_service.contracts.stats import SchedulerStats
from inference_service.llm.params import GenerationResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SampledLogprob:
    """A sampled token's log probability under the model (``logprobs``), and the ``top_logprobs``
    most likely ``(token id, log probability)`` at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepOutput:
    """What one :meth:`Engine.step` produced for one request.

    Attributes:
        piece: newly released text (possibly ``""``: an incomplete character or a possible
            stop-string prefix is held back).
        finished: the request ended in this step and was removed from the engine.
        result: when finished, how it ended; its ``remaining_text`` is the tail released
            only at the end (not part of ``piece``).
        tokens: the tokens sampled for the request that this output accounts for (the torch
            engine: 1; an engine that hands over held tokens: their number, possibly 0).
        error: set when the engine failed on this request alone (``finished`` is then true and
            ``result`` ``None``): :data:`REQUEST_FAULT`; the engine logged the cause.
        logprobs: with ``params.logprobs``, one entry per token this output accounts for, but an
            end-of-sequence or stop token that ended it (it has no text).
    """

    piece: str = ""
    finished: bool = False
    result: GenerationResult | None = None
    tokens: int = 1
    error: str | None = None
    logprobs: list[SampledLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine honours: every :class:`GenerationParams` field but those in ``unsupported``
    (field -> why), and its defaults of the engine settings every engine takes."""

    name: str
    unsupported: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    default_batched_tokens: int = 256  # max_num_batched_tokens when the handler config names none
    on_cpu: bool = True
    on_gpu: bool = False

    def honours(self, name: str) -> bool:
        return name not in self.unsupported


class Engine(Protocol):
    """Continuous batching of many requests (keys are the request ids). Not thread-safe: one thread
    drives it. Both engines implement it; ``tests/e2e/test_engine_behaviour.py`` holds them to it."""

    capabilities: EngineCapabilities
    max_num_seqs: int | None  # most requests running at once (the worker's batchSize)
    max_model_len: int | None  # most tokens of one request (prompt + generated)

    def __len__(self) -> int: ...

    def keys(self) -> list[str]: ...

    def has(self, key: str) -> bool: ...

    def stats(self) -> SchedulerStats: ...

    def check(self, params: GenerationParams) -> None:
        """What the engine must check before :meth:`add` and may take long for (compiling a
        structured output's grammar); thread-safe, so the handler runs it beside the step loop.
        Raises InvalidRequest naming the field."""
        ...

    def add(self, key: str, prompt_ids: Sequence[int], params: GenerationParams) -> None:
        """Add a request. Raises ValueError for a key already in the engine or empty ``prompt_ids``."""
        ...

    def step(self, active: Collection[str] | None = None) -> dict[str, StepOutput]:
        """Advance the ``active`` requests (``None``: all) one step; ``{key: output}`` for those
        that produced something or ended (ended ones are removed)."""
        ...

    def cancel(self, key: str) -> GenerationResult | None: ...

    def preempt(self, key: str) -> bool:
        """Drop ``key``'s KV cache; it is recomputed when it is active again (False: it held none)."""
        ...

    def close(self) -> None: ...


def refusal(capabilities: EngineCapabilities, params: GenerationParams,
            others: Sequence[EngineCapabilities] = ()) -> str | None:
    """Why an engine cannot honour ``params`` (a field set away from its default that it does not
    honour; the message names the field and which of ``others`` honour it), or ``None``."""
    defaults = GenerationParams()
    for f in fields(GenerationParams):
        if capabilities.honours(f.name) or getattr(params, f.name) == getattr(defaults, f.name):
            continue
        able = [f"'engine: {o.name}'" for o in others if o.name != capabilities.name and o.honours(f.name)]
        where = f"; serve the model with {' or '.join(able)} to use it" if able else ""
        why = capabilities.unsupported[f.name]
        return f"'{f.name}' is not supported by the {capabilities.name} engine ({why}){where}"
    return None


def capability_table(engines: Sequence[EngineCapabilities]) -> str:
    """docs/llm.md's table of which request field each engine honours (Markdown)."""
    lines = ["| Field | " + " | ".join(f"`{e.name}`" for e in engines) + " |",
             "|---|" + "---|" * len(engines)]
    for name in PARAM_FIELDS:
        cells = ["yes" if e.honours(name) else f"no: {e.unsupported[name]}" for e in engines]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: What a client is told when the engine failed on its request alone (gRPC INTERNAL, HTTP 500):
#: our words, never the engine's (its text can hold build paths and internals).
REQUEST_FAULT = "the engine failed on this request; the other requests go on (the worker log names the cause)"


def request_fault(key: str, exc: BaseException) -> StepOutput:
    """Log why the engine failed on request ``key`` and return its :data:`REQUEST_FAULT` output."""
    log.error("request %s failed in the engine and ends alone: %s: %s", key, type(exc).__name__, exc,
              exc_info=exc)
    return StepOutput(finished=True, tokens=0, error=REQUEST_FAULT)


def add_request(engine: Engine, key: str, prompt_ids: Sequence[int], params: GenerationParams) -> StepOutput | None:
    """``engine.add(...)``; when the engine refuses the request (any exception), its
    :data:`REQUEST_FAULT` output instead, the cause logged: the other requests go on."""
    try:
        engine.add(key, prompt_ids, params)
    except Exception as exc:  # noqa: BLE001 - one request's fault ends that request alone
        return request_fault(key, exc)
    return None


def run_to_the_end(engine: Engine, prompts: Sequence[Sequence[int]], params: GenerationParams,
                   max_steps: int) -> list[list[int]]:
    """The generated token ids of each of ``prompts``, added to ``engine`` together (keys ``"0"``,
    ``"1"``, ...) and stepped until every one has ended (a conversion check, a test).

    Raises:
        RuntimeError: not every request ended within ``max_steps`` steps.
    """
    for i, ids in enumerate(prompts):
        engine.add(str(i), ids, params)
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        for key, out in engine.step().items():
            if out.finished and out.result is not None:
                done[key] = list(out.result.token_ids)
        if len(done) == len(prompts):
            return [done[str(i)] for i in range(len(prompts))]
    raise RuntimeError(f"{len(prompts) - len(done)} of {len(prompts)} requests did not end in {max_steps} steps")
