"""The choices of one OpenAI request: ``n`` choices (or ``best_of`` candidates) of each prompt run
as engine requests of their own, seeded ``seed``, ``seed + 1``, ... (vLLM fans ``n`` out the same
way), their streams merged into one, the ``best_of`` candidates ranked. Prefix caching makes the
shared prompt cheap on the OpenVINO engine. See docs/clients.md, "OpenAI-compatible API".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from inference_service.contracts.outputs import TokenLogprob
from inference_service.contracts.sampling import GenerationRequest
from inference_service.frontends.openai.format import Outcome
from inference_service.frontends.openai.schemas import Usage

#: Most engine requests one OpenAI request may become (prompts x ``best_of`` or ``n``) by
#: default (config.properties ``max_engine_requests``).
MAX_ENGINE_REQUESTS = 64
#: Messages of the merged streams held for the answer writer (each stream's own flow control
#: stops its worker beyond that).
_MERGE_BUFFER = 64

Stream = AsyncGenerator[tuple[bytes, bool], None]


class ChoiceError(ValueError):
    """A request whose choices cannot run as asked; ``param`` is the OpenAI field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChoicePlan:
    """The engine requests of one OpenAI request, in candidate order (``prompt index * best_of + i``).

    Attributes:
        bodies: the handler request of each candidate.
        n: the choices of each prompt.
        best_of: the candidates of each prompt (``n`` unless ``best_of`` is larger).
        logprobs: the client asked for log probabilities (``best_of`` asks for them anyway, to rank).
    """

    bodies: list[bytes]
    n: int
    best_of: int
    logprobs: bool

    @classmethod
    def of(cls, requests: Sequence[GenerationRequest], stream: bool,
           limit: int = MAX_ENGINE_REQUESTS) -> ChoicePlan:
        """The plan of the LLM requests of each prompt.

        Raises:
            ChoiceError: more than ``limit`` engine requests (``max_engine_requests``), or
                ``best_of`` above ``n`` on a stream (as OpenAI's, the best are known only at the end).
        """
        params = requests[0].params
        n = params.n
        best = max(params.best_of or n, n)
        if best > n and stream:
            raise ChoiceError("'best_of' above 'n' cannot be streamed: the best are known only at the end", "best_of")
        if len(requests) * best > limit:
            raise ChoiceError(f"{len(requests)} prompt(s) x {best} choice(s) exceed the {limit} engine requests one "
                              "request may make (max_engine_requests)", "prompt" if len(requests) > 1 else "n")
        bodies = [request.choice(i, logprobs=best > n).to_body() for request in requests for i in range(best)]
        return cls(bodies, n, best, params.logprobs)


async def merged(streams: Sequence[Stream]) -> AsyncGenerator[tuple[int, bytes, bool], None]:
    """``(candidate, payload, final)`` of every stream as it comes. The first failure is raised (the
    other streams are closed); closing the merge closes every stream, aborting its request."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for payload, final in only:
                yield 0, payload, final
        return
    queue: asyncio.Queue[tuple[int, bytes | BaseException, bool]] = asyncio.Queue(_MERGE_BUFFER)

    async def pump(index: int, stream: Stream) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for payload, final in stream:
                    await queue.put((index, payload, final))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, exc, True))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item, final = await queue.get()
            if isinstance(item, BaseException):
                raise item
            running -= final
            yield index, item, final
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Candidate:
    """What one candidate produced so far."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    outcome: Outcome | None = None

    def score(self) -> float:
        """Its mean log probability per token (``best_of`` keeps the highest, as OpenAI's)."""
        return sum(e.logprob for e in self.logprobs) / len(self.logprobs) if self.logprobs else 0.0


def whole_choices(plan: ChoicePlan, candidates: Sequence[Candidate]) -> list[tuple[int, str, Outcome]]:
    """``(index, text, outcome)`` of each choice, the ``n`` best of each prompt's candidates with
    ``best_of`` (best first); the outcome's ``logprobs`` are the whole text's, if asked for."""
    choices = []
    for first in range(0, len(candidates), plan.best_of):
        group = list(range(first, first + plan.best_of))
        if plan.best_of > plan.n:
            group = sorted(group, key=lambda c: -candidates[c].score())[:plan.n]
        for rank, c in enumerate(group):
            candidate = candidates[c]
            outcome = candidate.outcome
            assert outcome is not None
            entries = tuple(candidate.logprobs) if plan.logprobs else None
            index = first // plan.best_of * plan.n + rank
            choices.append((index, "".join(candidate.texts),
                            Outcome(outcome.text, outcome.reason, outcome.usage, entries)))
    return choices


def total_usage(plan: ChoicePlan, outcomes: Sequence[Outcome]) -> Usage | None:
    """The request's token counts: each prompt's once, every candidate's generated tokens
    (``best_of`` ones included); ``None`` when a handler did not report them."""
    counts = [o.usage for o in outcomes]
    if not counts or any(c is None for c in counts):
        return None
    prompt = sum(c.prompt_tokens for c in counts[::plan.best_of] if c is not None)
    completion = sum(c.completion_tokens for c in counts if c is not None)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
