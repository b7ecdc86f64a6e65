"""The streaming LLM handler in generator form (static batches only).

Same model loading, configuration, request format, validation (status 400)
and final message as :mod:`inference_service.llm.handler` (see its docstring,
including the ``include_usage`` JSON object), and the same batched generation:
all requests of a batch are generated together by the shared
:class:`~inference_service.llm.engine.GenerationEngine`. ``handle`` is a
generator function: each ``yield`` is a list with one entry per request of the
batch (the new text piece of each request that released text in this step,
``None`` for the others), which the worker sends as intermediate messages; the
generator's ``return`` value is the list of final messages. When the client
cancels, the worker calls ``close()`` on the generator, which stops generation
at once (``GeneratorExit`` at the pending ``yield``) and frees the KV cache.

This form serves static batches only (``continuousBatching`` absent or false):
TorchServe's continuous batching contract calls ``handle`` once per step and
needs plain results, which :class:`~inference_service.llm.handler.LLMHandler`
gives.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from inference_service.handler import Context
from inference_service.llm.handler import LLMHandler


class LLMGeneratorHandler(LLMHandler):
    """The :class:`~inference_service.llm.handler.LLMHandler` whose ``handle`` is a generator."""

    def handle(  # type: ignore[override]
        self, data: list[dict[str, Any]], context: Context
    ) -> Generator[list[Any], None, list[Any]]:
        """Generate all requests of the batch together, yielding each step's text pieces.

        Args:
            data: one input map per request (body under ``data`` or ``body``).
            context: the worker's context for this batch.

        Yields:
            Lists of ``len(data)`` entries: the new text piece of each request that
            released text in this step, ``None`` for the others (at least one entry is
            not ``None``).

        Returns:
            One final message per request (the remaining text or the usage
            object; a rejected request's error message, which the worker
            discards in favour of INVALID_ARGUMENT).
        """
        batch = self._generate_batch(data, context)
        try:
            pieces = next(batch)
            while True:
                message: list[Any] = [None] * len(data)
                for idx, piece in pieces.items():
                    message[idx] = piece
                yield message
                pieces = batch.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            batch.close()  # on GeneratorExit: stop generating and free the KV cache now
