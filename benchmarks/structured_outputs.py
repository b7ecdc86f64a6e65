#!/usr/bin/env python3
"""What a JSON schema costs a batch of streams, and how often the bundled model calls a tool by
itself (issue 38: 8 streams under a JSON schema keep >= 0.8x the tokens/s of 8 unconstrained ones).

Throughput: the bundled SmolLM2 archive (``--engine openvino``, its default, or ``torch``) serves
8 concurrent streamed chat completions of ``--tokens`` tokens each, first unconstrained
(``ignore_eos``), then under a JSON schema that cannot close before that many tokens (an array of
at least 64 strings), alternating over ``--runs``. Figure: completion tokens of the 8 streams /
wall time from the first request to the last token, the median over the runs; then the ratio.

``--auto-rate``: the 20 committed tool cases of ``tests/e2e/data/tool_calls.json`` with
``tool_choice: auto``; prints how many answers call a tool (docs/llm.md, "Tool calls").

Usage: .venv/bin/python benchmarks/structured_outputs.py [--runs 3] [--tokens 128] [--engine openvino|torch]
           [--auto-rate] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
from common import ROOT, Server, serving_smollm2

GOAL = 0.8
STREAMS = 8
#: A schema whose answer is still open after any number of tokens the runs ask for.
LONG_SCHEMA = {"type": "array", "minItems": 64, "items": {"type": "string", "maxLength": 40}}
PROMPTS = ["List things you would find in a kitchen.", "Name some cities in Europe.", "Write words about the sea.",
           "List animals of the forest.", "Name colours and shades.", "Write the names of fruits.",
           "List tools of a carpenter.", "Name musical instruments."]


def client(server: Server) -> openai.OpenAI:
    key = server.headers["Authorization"].removeprefix("Bearer ")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=600)


def one_stream(api: openai.OpenAI, model: str, prompt: str, tokens: int, constrained: bool) -> tuple[int, float]:
    """``(completion tokens, monotonic time of the last chunk)`` of one streamed chat completion."""
    extra: dict[str, Any] = ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "long", "schema": LONG_SCHEMA}}} if constrained else {"extra_body": {"ignore_eos": True}})
    usage = 0
    with api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
                                     stream=True, stream_options={"include_usage": True}, **extra) as stream:
        for chunk in stream:
            usage = chunk.usage.completion_tokens if chunk.usage else usage
    return usage, time.monotonic()


def throughput(api: openai.OpenAI, model: str, tokens: int, constrained: bool) -> float:
    """Tokens/s of 8 concurrent streams."""
    start = time.monotonic()
    with ThreadPoolExecutor(STREAMS) as pool:
        done = list(pool.map(lambda p: one_stream(api, model, p, tokens, constrained), PROMPTS[:STREAMS]))
    total = sum(count for count, _ in done)
    if total != STREAMS * tokens:
        raise SystemExit(f"expected {STREAMS * tokens} tokens, got {total}: a stream ended early")
    return total / (max(end for _, end in done) - start)


def auto_rate(api: openai.OpenAI, model: str) -> tuple[int, int]:
    """``(answers with a tool call, cases)`` of the committed tool cases under ``tool_choice: auto``."""
    data = json.loads((ROOT / "tests" / "e2e" / "data" / "tool_calls.json").read_text(encoding="utf-8"))
    called = 0
    for case in data["cases"]:
        tools = [{"type": "function", "function": {"name": name, **data["tools"][name]}} for name in case["tools"]]
        answer = api.chat.completions.create(model=model, messages=[{"role": "user", "content": case["prompt"]}],
                                             tools=tools, tool_choice="auto", max_tokens=128)
        called += bool(answer.choices[0].message.tool_calls)
    return called, len(data["cases"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--engine", choices=("openvino", "torch"), default="openvino")
    parser.add_argument("--auto-rate", action="store_true", help="also measure tool_choice auto's call rate")
    parser.add_argument("--smoke", action="store_true", help="1 run of 16 tokens: a check that it works")
    args = parser.parse_args()
    runs, tokens = (1, 16) if args.smoke else (args.runs, args.tokens)
    with serving_smollm2(args.engine, "structured-bench-") as server:
        api = client(server)
        one_stream(api, "smollm2", PROMPTS[0], 4, True)  # the worker loads XGrammar once
        free: list[float] = []
        schema: list[float] = []
        for _ in range(runs):
            free.append(throughput(api, "smollm2", tokens, False))
            schema.append(throughput(api, "smollm2", tokens, True))
        rate = auto_rate(api, "smollm2") if args.auto_rate else None
    unconstrained, constrained = statistics.median(free), statistics.median(schema)
    ratio = constrained / unconstrained
    print(f"engine {args.engine}, {STREAMS} streams of {tokens} tokens, {runs} run(s), median tokens/s:")
    print(f"  unconstrained: {unconstrained:.1f}   (runs: {', '.join(f'{v:.1f}' for v in free)})")
    print(f"  JSON schema:   {constrained:.1f}   (runs: {', '.join(f'{v:.1f}' for v in schema)})")
    print(f"  ratio: {ratio:.2f} (goal >= {GOAL}: {'met' if ratio >= GOAL else 'MISSED'})")
    if rate is not None:
        print(f"tool_choice auto: {rate[0]} of {rate[1]} answers call a tool")
    print(json.dumps({"engine": args.engine, "streams": STREAMS, "tokens": tokens, "runs": runs,
                      "unconstrained_tps": round(unconstrained, 1), "schema_tps": round(constrained, 1),
                      "ratio": round(ratio, 3), "auto_calls": rate}))


if __name__ == "__main__":
    main()
