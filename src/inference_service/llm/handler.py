"""Streaming handler for causal language models (transformers), TorchServe style.

All requests a worker holds are generated together by one engine, in static batches or, with
``continuousBatching``, one engine step per call. Each finished request is recorded in
``context.metrics`` (``PromptTokens``, ``GenerationTokens``, ``RequestGenerationTime``).
See docs/llm.md."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any

from inference_service.contracts.outputs import TokenLogprob
from inference_service.contracts.stats import IterationStats
from inference_service.contracts.tokenizer import parse_tokenizer_request
from inference_service.contracts.wire import EngineInfo
from inference_service.handler import BaseHandler, Context, send_intermediate_predict_response
from inference_service.handler.streaming import RequestCancelled
from inference_service.llm.active_request import ActiveRequest, cancelled, log_id
from inference_service.llm.engine_protocol import (
    REQUEST_FAULT,
    Engine,
    SampledLogprob,
    StepOutput,
    add_request,
    refusal,
)
from inference_service.llm.engines import CAPABILITIES, build_engine, engine_name
from inference_service.llm.generation import build_prompt_ids, final_message
from inference_service.llm.grammar_check import ConstraintBudget, GrammarChecker
from inference_service.llm.handler_config import apply_chat_template, continuous_batching, warn_retired
from inference_service.llm.logprobs import TokenTexts
from inference_service.llm.params import GenerationParams, GenerationResult
from inference_service.llm.requests import (
    GenerationRequest,
    InvalidRequest,
    check_prompt_size,
    max_token_chars,
    parse_input_row,
)
from inference_service.llm.static_batch import Pieces, generate_batch, send_pieces
from inference_service.llm.tokenize import answer as tokenizer_answer

log = logging.getLogger(__name__)

#: The warm-up request's chat (45 prompt tokens with SmolLM2's template).
_WARM_UP_CHAT = ({"role": "user", "content": "Say hello to the first client of the day, in a few words."},)
#: How long a continuous-batching call waits for a tokenization when it has nothing else to run.
_PREPARE_WAIT_S = 0.05
#: Request bodies up to this many bytes are parsed and tokenized in the step itself (well
#: under a millisecond); larger ones on a thread, so the running streams do not wait for them.
_INLINE_BODY_BYTES = 16384
#: Why a TorchServe door's request may not ask for several choices.
_ONE_CHOICE = ("'{}' above 1 is answered by the OpenAI door (/v1/chat/completions, /v1/completions), which "
               "runs one request per choice; this door streams one answer")

#: What a request becomes in the handler: the request and its prompt ids, or a tokenizer request's answer.
Prepared = tuple[GenerationRequest, list[int]] | dict[str, Any]

#: The request fields that carry a structured output.
_CONSTRAINT_FIELDS = ("structured_outputs", "response_format")


def _body_size(row: Any) -> int:
    """The size of a request's raw body, or of a decoded JSON body's prompt or message contents."""
    body = row.get("data", row.get("body")) if isinstance(row, dict) else row
    if isinstance(body, dict):  # an application/json body the worker decoded (decode_input_request)
        inner = body.get("tokenize")
        body = inner if isinstance(inner, dict) else body
        messages = body.get("messages")
        texts = [body.get("prompt")]
        if isinstance(messages, list):
            texts += [m.get("content") for m in messages if isinstance(m, dict)]
        return sum(len(text) for text in texts if isinstance(text, str))
    return len(body) if isinstance(body, (bytes, bytearray, memoryview, str)) else 0


def _constrained(row: Any) -> bool:
    """Whether a request may ask for a structured output (its grammar is compiled on a thread)."""
    body = row.get("data", row.get("body")) if isinstance(row, dict) else row
    if isinstance(body, dict):
        return any(body.get(key) is not None for key in _CONSTRAINT_FIELDS)
    if isinstance(body, str):
        return any(key in body for key in _CONSTRAINT_FIELDS)
    if isinstance(body, (bytes, bytearray, memoryview)):
        return any(key.encode() in bytes(body) for key in _CONSTRAINT_FIELDS)
    return False


def _vocabulary(tokenizer: Any, engine: Any) -> Callable[[], str]:
    """XGrammar's vocabulary of ``tokenizer`` as JSON, for the grammar checker (read when first asked)."""
    def read() -> str:
        from inference_service.llm.grammar import tokenizer_info

        return str(tokenizer_info(tokenizer, len(tokenizer), getattr(engine, "eos", ())).serialize_json())
    return read


def _criterion(finished: bool) -> Callable[[Any], bool]:
    return lambda _result: finished


class LLMHandler(BaseHandler):
    """Stream text generated by a causal LM, requests batched together (see the module docstring)."""

    #: takes the typed LLM request (contracts/sampling.py): OpenAI's ``/v1/models`` lists the model
    accepts_generation_requests = True

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer: Any = None
        self.engine: Engine | None = None
        self.engine_name = "torch"
        self.engine_info: EngineInfo | None = None
        self.defaults = GenerationParams()
        self.context_length: int | None = None
        self.model_path: str | None = None
        self._jobs: dict[str, ActiveRequest] = {}  # continuous mode: request id -> job
        self._preparing: dict[str, Future[Prepared]] = {}  # continuous: tokenizing
        self._prepare_pool: ThreadPoolExecutor | None = None
        self.max_prompt_chars: int | None = None
        self._batches = 0  # static mode: batch counter, makes engine keys unique
        self._iteration = IterationStats()  # tokens counted since the last report to the server
        self._token_texts: TokenTexts | None = None  # log probability entries (built with the tokenizer)
        self._grammar_checker: GrammarChecker | None = None  # tries a structured output within its budget

    def initialize(self, context: Context) -> None:
        """Read the typed ``handler`` config, convert the model if not cached, build the engine.

        Raises:
            inference_service.contracts.handler_config.HandlerConfigError: an invalid key.
            inference_service.llm.model.ModelPreparationError: the model cannot be loaded.
            inference_service.llm.engines.EngineConfigError: an engine this worker cannot run.
        """
        config = context.handler_config.within((context.system_properties or {}).get("model_dir", ""))
        on_gpu = (context.system_properties or {}).get("gpu_id") is not None
        name = engine_name(config, "cuda" if on_gpu else "cpu")
        if name == "torch":
            super().initialize(context)  # device, manifest, model_dir; the manifest names no weights
            device = str(self.device)
        else:  # the engine places the model itself (OpenVINO: no torch at all, about 340 MB less memory)
            self._initialize_light(context, name)
            device = f"cuda:{(context.system_properties or {}).get('gpu_id')}" if on_gpu and name == "vllm" else "cpu"
        self.initialized = False
        warn_retired(config)
        self.defaults = config.generation
        batch_size = (context.system_properties or {}).get("batch_size")
        max_num_seqs = batch_size if isinstance(batch_size, int) and batch_size > 0 else None
        built = build_engine(config, device, max_num_seqs, continuous_batching(context))
        self.engine, self.tokenizer, self.context_length = built.engine, built.tokenizer, built.context_length
        self._token_texts = TokenTexts(self.tokenizer)
        self._grammar_checker = GrammarChecker(_vocabulary(self.tokenizer, built.engine), ConstraintBudget(
            config.structured_outputs_budget_ms / 1000, config.structured_outputs_token_budget_ms / 1000,
            config.structured_outputs_max_mb << 20))
        self.model, self.model_path, self.engine_name = built.model, built.model_path, built.name
        template = apply_chat_template(self.tokenizer, config)
        self.engine_info = replace(built.info or EngineInfo(built.name), chat_template=template)  # READY: DescribeModel
        if name != "torch":
            log.info("warm-up request took %.2f s", self._warm_up())
        self.max_prompt_chars = (
            self.context_length * max_token_chars(self.tokenizer) if self.context_length is not None else None
        )
        self._jobs.clear()
        self._iteration = IterationStats()
        self._report_engine()  # before READY: the server knows the model as an LLM from its first request
        self.initialized = True
        log.info("generation mode: %s", "continuous batching" if continuous_batching(context) else "static batches")

    def _initialize_light(self, context: Context, name: str) -> None:
        """What :meth:`BaseHandler.initialize` sets, without importing torch (OpenVINO needs none)."""
        import sys

        if name == "openvino" and "transformers" not in sys.modules and "torch" not in sys.modules:
            os.environ["USE_TORCH"] = "0"  # transformers' own switch: tokenizers without torch
        self.context = context
        self.manifest = context.manifest
        self.model_yaml_config = context.model_yaml_config or {}
        self.model_dir = (context.system_properties or {}).get("model_dir", "")
        self.map_location = "cpu"
        self.device = None

    def _warm_up(self) -> float:
        """One short chat request, so the first client pays neither for compiling nor for the
        engine's first multi-token prefill (200-400 ms after a one-token warm-up); returns its seconds."""
        engine = self._engine()
        start = time.perf_counter()
        try:
            ids = build_prompt_ids(self.tokenizer, GenerationRequest(None, _WARM_UP_CHAT), self.context_length)
        except InvalidRequest:  # no chat template, or a very short context
            ids = list(self.tokenizer("Hello")["input_ids"]) or [0]
        engine.add("#warm-up", ids, GenerationParams(max_new_tokens=4, ignore_eos=True))
        deadline = start + 120.0
        while engine.has("#warm-up") and time.perf_counter() < deadline:
            engine.step(["#warm-up"])
        engine.cancel("#warm-up")
        return time.perf_counter() - start

    # --- shared by both modes and both handler forms ---------------------------------
    def _engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("LLMHandler.initialize was not called")
        return self.engine

    def _prepare(self, row: Any, idx: int, context: Context) -> Prepared | str:
        """:data:`Prepared`, or on bad input the error message (status 400 set)."""
        try:
            return self._tokenize(row)
        except InvalidRequest as exc:
            context.set_response_status(400, str(exc), idx)
            return str(exc)

    def _tokenize(self, row: Any) -> Prepared:
        """Parse and tokenize ``row`` (or answer its tokenizer request), and have the engine check it (a
        structured output compiles); InvalidRequest if malformed, if its prompt cannot fit or its
        constraint does not compile."""
        body = row.get("data", row.get("body")) if isinstance(row, dict) else row
        asked = parse_tokenizer_request(body)
        if asked is not None:
            return tokenizer_answer(self.tokenizer, asked, self.context_length)
        request = parse_input_row(row, self.defaults)
        for name in ("n", "best_of"):
            if (getattr(request.params, name) or 1) > 1:
                raise InvalidRequest(_ONE_CHOICE.format(name), name)
        refused = refusal(self._engine().capabilities, request.params, tuple(CAPABILITIES.values()))
        if refused is not None:
            raise InvalidRequest(refused)
        check_prompt_size(request, self.max_prompt_chars)
        prompt_ids = build_prompt_ids(self.tokenizer, request, self.context_length)
        if request.params.structured_outputs is not None and self._grammar_checker is not None:
            self._grammar_checker.check(request.params.structured_outputs)  # within its budget, off the step
        self._engine().check(request.params)
        return request, prompt_ids

    def _message(self, job: ActiveRequest, out: StepOutput) -> str | dict[str, Any] | None:
        """What a step output sends: its text piece, or with ``logprobs`` the piece object (``None``: nothing)."""
        if not job.request.params.logprobs or self._token_texts is None:
            return out.piece or None
        return self._token_texts.piece(out.piece, out.logprobs)

    def _count(self, job: ActiveRequest, tokens: int | None) -> None:
        """Count a step's sampled ``tokens`` (the prompt with the first; ``None``: cancelled)."""
        if tokens:
            self._iteration.generation_tokens += tokens
        if not job.prefilled and tokens != 0:
            job.prefilled = True
            self._iteration.prompt_tokens += job.prompt_tokens

    def _report_engine(self) -> None:
        """Send the tokens counted since the last report and the engine's state to ``/metrics``."""
        engine = self.engine
        add = getattr(getattr(self.context, "metrics", None), "add_stats", None)
        if engine is None or not callable(add):
            return
        iteration, self._iteration = self._iteration, IterationStats()
        add(engine.stats(), iteration)

    def _finish(self, job: ActiveRequest, result: GenerationResult, idx: int,
                logprobs: Sequence[SampledLogprob] = (), held: Sequence[TokenLogprob] = ()) -> str | dict[str, Any]:
        """Log and record the request's token counts and speed; return its final message (with
        ``logprobs``: the ``held`` entries not sent, then those of the last output)."""
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
        entries = [*held, *self._token_texts.entries(logprobs)] if self._token_texts is not None else []
        return final_message(result, job.request.params, entries)

    @staticmethod
    def _fail(out: StepOutput, idx: int, context: Context) -> str:
        """Answer request ``idx`` with the engine fault of ``out`` (status 500, gRPC INTERNAL)."""
        message = out.error or REQUEST_FAULT
        context.set_response_status(500, message, idx)
        return message

    def _text_apart(self, idx: int, text: str, context: Context) -> bool:
        """Send a finishing request's last text apart, leaving the usage object alone; False if it cannot."""
        request_id = context.request_ids.get(idx)
        if request_id is None or getattr(context, "_channel", None) is None or cancelled(context, idx):
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
    def _generate_batch(self, data: list[dict[str, Any]], context: Context) -> Pieces:
        """The batch's generator: see :func:`~inference_service.llm.static_batch.generate_batch`."""
        self.context = context
        self._batches += 1
        return generate_batch(self, f"batch{self._batches}", data, context)

    # --- the TorchServe entry point --------------------------------------------------
    def handle(self, data: list[dict[str, Any]], context: Context) -> list[Any]:
        """Serve one call of the worker: a whole static batch, or one continuous-batching step.

        Returns one result per request. Raises RequestCancelled when every client of a static
        batch went away.
        """
        if continuous_batching(context):
            return self.step_continuous(data, context)
        return send_pieces(self._generate_batch(data, context), len(data), context)

    # --- continuous batching -----------------------------------------------------------
    def step_continuous(self, data: list[dict[str, Any]], context: Context) -> list[Any]:
        """One continuous-batching call: add the new requests, run one engine step over this
        call's requests, return what each produced.

        ``data`` holds ``{}`` for a request already running; running requests absent from
        ``context.request_ids`` are paused. Returns one result per request: the new text piece
        (``None``: none yet), the final message, or the error message (status 400 set). A forward
        pass error drops the call's requests from the engine, then propagates.
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
                    if status == 500:  # a bug, not the client's: its trace goes to the log
                        log.error("request %s failed before generation", log_id(context, idx), exc_info=prepared)
                    context.set_response_status(status, message, idx)
                    results[idx] = message
                    finished[idx] = True
                    continue
                if isinstance(prepared, dict):  # a tokenizer request: answered at once
                    results[idx] = prepared
                    finished[idx] = True
                    continue
                request, prompt_ids = prepared
                fault = add_request(engine, key, prompt_ids, request.params)
                if fault is not None:
                    results[idx] = self._fail(fault, idx, context)
                    finished[idx] = True
                    continue
                self._jobs[key] = ActiveRequest(key, request, log_id(context, idx), time.perf_counter(),
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
            if out.error is not None:
                self._jobs.pop(key)
                results[idx] = self._fail(out, idx, context)
                finished[idx] = True
            elif out.finished and out.result is not None:
                job = self._jobs.pop(key)
                text = out.piece + out.result.remaining_text
                params = job.request.params
                if text and params.include_usage and not params.logprobs and self._text_apart(idx, text, context):
                    text = ""
                out.result.remaining_text = text
                results[idx] = self._finish(job, out.result, idx, out.logprobs)
                finished[idx] = True
            else:
                results[idx] = self._message(self._jobs[key], out)
        context.stopping_criteria = [_criterion(f) for f in finished]
        self._report_engine()
        return results

    def _prepared(self, key: str, row: Any) -> Prepared | BaseException | None:
        """The tokenized request (or tokenizer answer), its error, or ``None`` while a thread still
        tokenizes a large body."""
        future = self._preparing.get(key)
        if future is None:
            if _body_size(row) <= _INLINE_BODY_BYTES and not _constrained(row):
                try:
                    return self._tokenize(row)
                except Exception as exc:  # this request's error alone (a tokenizer's, too): 400 or 500
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
        """Drop the KV cache of requests whose clients stopped reading (vLLM's recompute preemption)."""
        engine = self._engine()
        for request_id in request_ids:
            if engine.preempt(request_id):
                log.info("request %s preempted: its client stopped reading", request_id)
        self._report_engine()  # the gauges show it now, even if no step runs until it resumes

    def drop_requests(self, request_ids: list[str]) -> None:
        """Forget requests gone for good (cancelled, deadline passed); unknown ids are ignored."""
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
