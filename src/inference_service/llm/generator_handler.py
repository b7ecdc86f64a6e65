"""The streaming LLM handler in generator form (static batches only).

As :class:`~inference_service.llm.handler.LLMHandler`, but ``handle`` yields one list per step
(a text piece or ``None`` per request) and returns the final messages; the worker's ``close()``
on cancel stops generation at the pending ``yield`` and frees the KV cache. Continuous batching
needs plain results per step, so it uses ``LLMHandler``. See docs/llm.md.
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
        """Generate all requests of the batch together, yielding per step a list of ``len(data)`` entries
        (a request's new text piece, or ``None``; at least one not ``None``), and returning one final
        message per request (a rejected request's is discarded for INVALID_ARGUMENT)."""
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
