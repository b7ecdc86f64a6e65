"""The LLM handler's static-batch path (``continuousBatching`` absent or false): all requests
of one batch are generated together, step by step until all are done, each step's new text
pieces sent at once as intermediate messages.

:func:`generate_batch` is the one loop both handler forms drive:
:class:`~inference_service.llm.handler.LLMHandler` through :func:`send_pieces`,
:class:`~inference_service.llm.generator_handler.LLMGeneratorHandler` by yielding the pieces.
See docs/llm.md.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Any, Protocol

from inference_service.contracts.outputs import TokenLogprob
from inference_service.handler import Context, send_intermediate_predict_response
from inference_service.llm.active_request import ActiveRequest, cancelled, log_id
from inference_service.llm.engine_protocol import Engine, SampledLogprob, StepOutput, add_request
from inference_service.llm.logprobs import held_messages
from inference_service.llm.params import GenerationResult
from inference_service.llm.requests import GenerationRequest

Message = str | dict[str, Any]
"""An intermediate message: a text piece, or with ``logprobs`` the piece object."""
Pieces = Generator[dict[int, Message], set[int] | None, list[Any]]
"""Yields ``{batch index: new message}`` per step, takes the undelivered indices, returns the
final messages."""


class BatchHost(Protocol):
    """What :func:`generate_batch` uses of the handler (:class:`~.handler.LLMHandler`)."""

    def _engine(self) -> Engine: ...

    def _prepare(self, row: Any, idx: int, context: Context) -> tuple[GenerationRequest, list[int]] | Message: ...

    def _count(self, job: ActiveRequest, tokens: int | None) -> None: ...

    def _message(self, job: ActiveRequest, out: StepOutput) -> Message | None: ...

    def _finish(self, job: ActiveRequest, result: GenerationResult, idx: int,
                logprobs: Sequence[SampledLogprob] = (), held: Sequence[TokenLogprob] = ()) -> Message: ...

    def _report_engine(self) -> None: ...

    def _fail(self, out: StepOutput, idx: int, context: Context) -> str: ...


def generate_batch(host: BatchHost, prefix: str, data: list[dict[str, Any]], context: Context) -> Pieces:
    """Generate all requests of one batch together (engine keys ``{prefix}:{index}``).

    Yields, once per engine step that released text, ``{batch index: new message}`` (non-empty
    pieces, or piece objects with ``logprobs``). The driver sends back the indices whose piece it could not
    deliver (no request id: called outside a worker); those pieces are kept for that
    request's final message. Before every step, requests whose client cancelled
    (``context.is_cancelled``) are dropped from the engine. Closing the generator stops
    generation at once and frees the KV cache of every request of the batch.

    Returns:
        One final message per request: the text not yet sent, or the usage object
        (docs/llm.md, "The stream's messages"); for a request that failed validation, its
        error message (discarded by the worker, which answers INVALID_ARGUMENT); for a
        tokenizer request, its answer.
    """
    engine = host._engine()
    results: list[Any] = [None] * len(data)
    live: dict[int, ActiveRequest] = {}
    unsent: dict[int, list[Message]] = {}
    try:
        for idx, row in enumerate(data):
            prepared = host._prepare(row, idx, context)
            if not isinstance(prepared, tuple):  # an error message, or a tokenizer request's answer
                results[idx] = prepared
                continue
            request, prompt_ids = prepared
            job = ActiveRequest(f"{prefix}:{idx}", request, log_id(context, idx), time.perf_counter(),
                                len(prompt_ids))
            fault = add_request(engine, job.key, prompt_ids, request.params)
            if fault is not None:
                results[idx] = host._fail(fault, idx, context)
                continue
            live[idx] = job
        while live:
            for idx in [i for i in live if cancelled(context, i)]:
                job = live.pop(idx)
                dropped = engine.cancel(job.key)
                if dropped is not None:
                    host._count(job, None)
                    results[idx] = host._finish(job, dropped, idx)
            if not live:
                break
            outputs = engine.step([job.key for job in live.values()])
            pieces: dict[int, Message] = {}
            finished: list[tuple[int, ActiveRequest, StepOutput]] = []
            failed: list[int] = []
            for idx, job in live.items():
                out = outputs.get(job.key)
                if out is None:
                    continue
                host._count(job, out.tokens)
                if out.error is not None:
                    failed.append(idx)
                    results[idx] = host._fail(out, idx, context)
                elif out.finished and out.result is not None:
                    finished.append((idx, job, out))
                    if out.piece:  # with logprobs its entries go with the final message
                        pieces[idx] = out.piece
                elif (message := host._message(job, out)) is not None:
                    pieces[idx] = message
            host._report_engine()
            for idx in failed:
                del live[idx]
                pieces.pop(idx, None)
            for idx, job, out in finished:
                del live[idx]
                result = out.result
                assert result is not None
                if job.request.params.logprobs:  # the final message carries the text with its entries
                    result.remaining_text = str(pieces.pop(idx, "")) + result.remaining_text
                elif job.request.params.include_usage and result.remaining_text:
                    # the usage object is a message of its own: the held-back text goes now
                    pieces[idx] = str(pieces.get(idx, "")) + result.remaining_text
                    result.remaining_text = ""
            if pieces:
                for idx in (yield pieces) or ():
                    unsent.setdefault(idx, []).append(pieces[idx])
            for idx, job, out in finished:
                result = out.result
                assert result is not None
                text, held = held_messages(unsent.pop(idx, []))
                result.remaining_text = text + result.remaining_text
                results[idx] = host._finish(job, result, idx, out.logprobs, held)
    finally:
        for job in live.values():  # closed early: client gone, error, GeneratorExit
            if engine.cancel(job.key) is not None:
                host._count(job, None)
        host._report_engine()
    return results


def send_pieces(batch: Pieces, size: int, context: Context) -> list[Any]:
    """Drive ``batch`` (of ``size`` requests) to its end, sending each step's pieces through
    :func:`~inference_service.handler.send_intermediate_predict_response`; returns the final
    messages. Closes ``batch`` whatever happens.

    Raises:
        RequestCancelled: from ``send_intermediate_predict_response``, when every client of the
            batch went away.
    """
    try:
        pieces = next(batch)
        while True:
            undelivered: set[int] = set()
            targets: dict[int, str] = {}
            for idx in pieces:
                request_id = context.request_ids.get(idx)
                if request_id is None:
                    undelivered.add(idx)
                elif not cancelled(context, idx):  # nobody to send to; it leaves before the next step
                    targets[idx] = request_id
            if targets:
                message: list[Any] = [None] * size
                for idx in targets:
                    message[idx] = pieces[idx]
                send_intermediate_predict_response(message, targets, "Intermediate Prediction success", 200, context)
            pieces = batch.send(undelivered)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        batch.close()
