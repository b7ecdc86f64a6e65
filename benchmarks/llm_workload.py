"""The client side of benchmarks/llm_peers.py, in the format of vLLM's ``vllm bench serve``: its
``random`` workload, its closed loop under ``--max-concurrency``, and its figures.

Workload: prompts of random token ids (seeded; drawn from the vocabulary without its special
tokens), decoded to text and re-encoded until the text is ``input_len`` tokens; greedy, exactly
``output_len`` tokens each (``ignore_eos``). A level sends N prompts through a semaphore of
``concurrency``: each request starts when one ends, so ``concurrency`` are in flight until the
last ones.

Figures of a level, as ``vllm bench serve`` defines them (seconds from ``time.perf_counter()``):

- a chunk is a streamed message with choices (completions' ``text``, chat's ``delta``; a chat
  chunk with only the role is not one): TTFT is from the request's send to its first chunk,
  ITL the gaps between its chunks, E2EL from the send to its last chunk;
- TPOT = (E2EL - TTFT) / (output tokens - 1), the time per output token after the first
  (requests of one token have none);
- output tokens: the usage the server reports, else the answer's text re-tokenized;
- output tokens/s, requests/s and goodput (requests/s that met every SLO, ``--goodput
  ttft:MS tpot:MS e2el:MS``; a request of one token counts as TPOT 0) over the level's duration,
  from its first send to its last answer;
- percentiles p50/p90/p99 of TTFT, TPOT, ITL (pooled over the requests) and E2EL in ms:
  ``common.percentile``, linear interpolation as numpy's (vLLM's) default.

A request that fails (HTTP status, broken stream, no chunk, timeout) counts in ``failed`` and
in none of the figures.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from common import Server, percentile

#: The request metrics with percentiles, and the percentiles, as ``vllm bench serve`` names them.
METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Prompt:
    """One prompt of the workload: its text and its length in tokens (re-encoded)."""

    text: str
    tokens: int


@dataclass
class RequestOutput:
    """One request as the client saw it (vLLM's ``RequestFuncOutput``); times in seconds."""

    prompt_len: int
    start: float = 0.0  #: time.perf_counter() at the send
    last: float = 0.0  #: at the latest chunk
    chunks: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    output_tokens: int = 0  #: the server's usage count, else the text re-tokenized
    error: str = ""  #: why it failed; empty when it succeeded

    def chunk(self, text: str) -> None:
        """A chunk arrived now."""
        now = time.perf_counter()
        if self.chunks == 0:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last, self.chunks, self.text = now, self.chunks + 1, self.text + text

    @property
    def latency(self) -> float:
        """E2EL: from the send to the last chunk."""
        return self.last - self.start


def random_prompts(tokenizer: Any, count: int, input_len: int, seed: int) -> list[Prompt]:
    """``count`` prompts of ``input_len`` tokens, as vLLM's ``random`` dataset makes them: ids drawn
    (``random.Random(seed)``) from the vocabulary without the special tokens, decoded, and the text
    re-encoded then cut or topped up until it encodes to ``input_len`` tokens (a byte-level
    vocabulary merges or splits pieces at the joins; after 10 rounds the last text is kept)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    allowed = [i for i in range(tokenizer.vocab_size) if i not in special]
    prompts = []
    for _ in range(count):
        text = tokenizer.decode(rng.choices(allowed, k=input_len))
        for _ in range(10):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == input_len:
                break
            ids = ids[:input_len] if len(ids) > input_len else ids + rng.choices(allowed, k=input_len - len(ids))
            text = tokenizer.decode(ids)
        prompts.append(Prompt(text, len(tokenizer.encode(text, add_special_tokens=False))))
    return prompts


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """The first 12 hex digits of the SHA-256 of the prompts' texts: the same digest, the same workload."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(prompt.text.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()[:12]


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:150"]`` -> ``{"ttft": 2000.0, "tpot": 150.0}`` (ms), vLLM's ``--goodput``.

    Raises:
        ValueError: not ``KEY:VALUE``, a key other than ttft, tpot or e2el, or a negative value.
    """
    slo: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes KEY:MS with KEY one of ttft, tpot, e2el; got {pair!r}")
        slo[key] = float(value)
        if slo[key] < 0:
            raise ValueError(f"--goodput {key}: a service level objective cannot be negative, got {value}")
    return slo


def serve_metrics(outputs: Sequence[RequestOutput], duration_s: float, slo_ms: dict[str, float]) -> dict[str, Any]:
    """The level's figures (see the module docstring); ``goodput_rps`` is None without SLOs."""
    done = [o for o in outputs if not o.error]
    tpot = {id(o): (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0 for o in done}
    values = {"ttft": [o.ttft for o in done], "tpot": [tpot[id(o)] for o in done if o.output_tokens > 1],
              "itl": [gap for o in done for gap in o.itl], "e2el": [o.latency for o in done]}
    good = sum(1 for o in done if all(
        {"ttft": o.ttft, "tpot": tpot[id(o)], "e2el": o.latency}[key] * 1000 <= bound for key, bound in slo_ms.items()))
    output_tokens = sum(o.output_tokens for o in done)
    figures: dict[str, Any] = {
        "completed": len(done), "failed": len(outputs) - len(done), "duration_s": round(duration_s, 3),
        "input_tokens": sum(o.prompt_len for o in done), "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s, "requests_per_s": len(done) / duration_s,
        "goodput_rps": good / duration_s if slo_ms else None}
    for name in METRICS:
        ms = [1000 * v for v in values[name]]
        figures.update({f"{name}_p{q}_ms": percentile(ms, q) for q in PERCENTILES})
    return figures


def openai_body(server: Server, prompt: str, output_len: int) -> dict[str, Any]:
    """The streamed request: ``/v1/completions``, or ``/v1/chat/completions`` (the prompt as the user's
    message) where ``server.transport`` is ``chat``; greedy, ``ignore_eos`` where the server takes it."""
    body: dict[str, Any] = {"model": server.model, "max_tokens": output_len, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if server.transport == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if server.name != "hf_serve":  # transformers serve answers 422 to fields it does not know
        body["ignore_eos"] = True
    return body


async def request_openai(session: aiohttp.ClientSession, server: Server, prompt: str, output_len: int,
                         out: RequestOutput) -> None:
    """One streamed completion into ``out``.

    Raises:
        RuntimeError: an HTTP status other than 200.
    """
    path = "/v1/chat/completions" if server.transport == "chat" else "/v1/completions"
    async with session.post(server.base_url + path, json=openai_body(server, prompt, output_len),
                            headers=server.headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            message = json.loads(line[5:])
            if message.get("usage"):
                out.output_tokens = int(message["usage"].get("completion_tokens") or 0)
            choices = message.get("choices") or []
            if not choices:
                continue
            if "delta" not in choices[0]:
                out.chunk(choices[0].get("text") or "")
            elif (delta := choices[0]["delta"] or {}).get("content") or choices[0].get("finish_reason") \
                    or "role" not in delta:
                out.chunk(delta.get("content") or "")


def handler_body(prompt: str, tokens: int) -> bytes:
    """The LLM handler's JSON body (gRPC, TorchServe) for the same request the OpenAI clients send."""
    return json.dumps({"prompt": prompt, "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True,
                       "include_usage": True}).encode()


def handler_message(data: bytes) -> tuple[bool, int | None]:
    """(is a chunk, completion tokens) of one handler message: the final ``include_usage`` object
    carries the count; TorchServe's ``null`` chunks are not content."""
    if data.startswith(b"{"):
        try:
            final = json.loads(data)
            return False, int(final["usage"]["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            pass
    return data not in (b"", b"null"), None


async def request_handler(session: aiohttp.ClientSession, stub: Any, server: Server, prompt: str, output_len: int,
                          out: RequestOutput) -> None:
    """One stream of the handler's messages into ``out``: gRPC StreamPredictions (``stub``) or
    TorchServe's chunked HTTP predictions (each chunk one message).

    Raises:
        RuntimeError: an HTTP status other than 200.
    """
    def take(data: bytes) -> None:
        content, count = handler_message(data)
        if content:
            out.chunk(data.decode("utf-8", "replace"))
        if count is not None:
            out.output_tokens = count

    body = handler_body(prompt, output_len)
    if stub is not None:
        from inference_service._proto import inference_pb2

        request = inference_pb2.PredictionsRequest(model_name=server.model, input={"data": body})
        async for reply in stub.StreamPredictions(request, metadata=server.metadata):
            take(reply.prediction)
        return
    async with session.post(f"{server.base_url}/predictions/{server.model}", data=body,
                            headers={"Content-Type": "application/json", **server.headers}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        buffer = b""
        async for data, end_of_chunk in resp.content.iter_chunks():
            buffer += data
            if end_of_chunk:
                take(buffer)
                buffer = b""
        take(buffer)


async def run_level(server: Server, prompts: Sequence[Prompt], concurrency: int, output_len: int,
                    count_tokens: Callable[[str], int], timeout_s: float = 900) -> tuple[list[RequestOutput], float]:
    """Every prompt once, at most ``concurrency`` in flight (vLLM's ``--max-concurrency`` semaphore),
    one HTTP session, a connection a request (or one gRPC channel); the outputs in prompt order and the level's seconds.
    ``count_tokens`` re-tokenizes an answer whose server reported no usage; a request gets
    ``timeout_s`` seconds."""
    from inference_service._proto import inference_pb2_grpc

    semaphore = asyncio.Semaphore(concurrency)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.inference_port}") if server.transport == "grpc" else None
    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel) if channel else None
    # a connection per request (localhost: a fraction of a millisecond): llama.cpp's HTTP server
    # closes a kept-alive connection after a few requests, and a reused one then fails the request
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                    connector=aiohttp.TCPConnector(limit=0, force_close=True))

    async def one(prompt: Prompt) -> RequestOutput:
        async with semaphore:
            out = RequestOutput(prompt.tokens, start=time.perf_counter())
            out.last = out.start
            try:
                if server.transport in ("openai", "chat"):
                    await asyncio.wait_for(request_openai(session, server, prompt.text, output_len, out), timeout_s)
                else:
                    await asyncio.wait_for(request_handler(session, stub, server, prompt.text, output_len, out),
                                           timeout_s)
                if out.chunks == 0:
                    out.error = "no chunk arrived"
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, grpc.RpcError) as exc:
                out.error = f"{type(exc).__name__}: {exc}"[:300]
            return out

    try:
        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - start
    finally:
        await session.close()
        if channel is not None:
            await channel.close()
    for out in outputs:
        if not out.error and not out.output_tokens:
            out.output_tokens = count_tokens(out.text)
    return list(outputs), duration
