"""A priority request's time to first token under load (issue 51): the bundled SmolLM2 archive (its
continuous batch of 8) answers one streamed chat completion alone, then the same request while 8
background streams hold every place, once at the default priority and once at ``priority: -1``
(vLLM's field: lower first). Prints TTFT medians in ms and the ratios to TTFT alone; the target is
priority -1 within 1.5x of alone.

Usage: ``.venv/bin/python benchmarks/priority_ttft.py [--runs 3] [--engine openvino]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import aiohttp
from common import Server, cpu_info, format_table, serving_smollm2

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def ttft(session: aiohttp.ClientSession, server: Server, priority: int | None, tokens: int = 8) -> float:
    """Seconds from sending a streamed chat completion to its first chunk with text."""
    body: dict[str, Any] = {"model": server.model, "messages": QUESTION, "max_tokens": tokens, "stream": True}
    if priority is not None:
        body["priority"] = priority
    start = time.perf_counter()
    first = None
    async with session.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no text chunk")
    return first


async def background(session: aiohttp.ClientSession, server: Server, stop: asyncio.Event) -> None:
    """One stream of 200 tokens after another until ``stop``."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 200, "stream": True, "ignore_eos": True}
    while not stop.is_set():
        async with session.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers) as resp:
            async for _ in resp.content:
                pass


async def scenario(server: Server, runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"alone": [], "loaded": [], "loaded_priority": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await ttft(session, server, None)  # warm
        for _ in range(runs):
            out["alone"].append(await ttft(session, server, None))
        stop = asyncio.Event()
        load = [asyncio.create_task(background(session, server, stop)) for _ in range(8)]
        await asyncio.sleep(3.0)  # the 8 streams fill the batch (they run until stopped)
        for _ in range(runs):
            out["loaded"].append(await ttft(session, server, None))
            out["loaded_priority"].append(await ttft(session, server, -1))
        stop.set()
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engine", default="openvino")
    args = parser.parse_args()
    with serving_smollm2(args.engine, "priority-ttft-") as server:
        figures = asyncio.run(scenario(server, args.runs))
    medians = {k: statistics.median(v) * 1000 for k, v in figures.items()}
    rows = [[k, f"{medians[k]:.0f}", f"{medians[k] / medians['alone']:.2f}x",
             " ".join(f"{x * 1000:.0f}" for x in figures[k])] for k in figures]
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} ({', '.join(cpu['flags'])}), {cpu['usable']} usable CPUs; engine {args.engine}")
    print(format_table(["TTFT", "median ms", "vs alone", "runs ms"], rows))
    met = medians["loaded_priority"] <= 1.5 * medians["alone"]
    print(json.dumps({"target": "priority -1 TTFT under 8 streams <= 1.5x alone", "ratio":
                      round(medians["loaded_priority"] / medians["alone"], 2), "met": met}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
