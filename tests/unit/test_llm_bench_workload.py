"""The LLM benchmark's client (benchmarks/llm_workload.py) measures as ``vllm bench serve`` does:
its figures from hand-made requests, its chunk rules against a real HTTP server streaming
canned answers, its random prompts with the real tokenizer, and the CPU line of its tables."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from common import Server, cpu_info  # noqa: E402
from llm_workload import (  # noqa: E402
    Prompt,
    RequestOutput,
    parse_goodput,
    prompts_digest,
    random_prompts,
    run_level,
    serve_metrics,
)


def done(start: float, chunks: list[float], tokens: int, prompt_len: int = 128) -> RequestOutput:
    """A finished request whose chunks arrived at ``chunks`` (seconds)."""
    out = RequestOutput(prompt_len, start=start, ttft=chunks[0] - start, chunks=len(chunks), last=chunks[-1],
                        output_tokens=tokens)
    out.itl = [b - a for a, b in zip(chunks, chunks[1:], strict=False)]
    return out


def test_figures_follow_vllm_bench_serve():
    fast = done(0.0, [0.1, 0.2, 0.3, 0.4, 0.5], 5)  # TTFT 100 ms, TPOT (500 - 100) / 4 = 100 ms
    slow = done(1.0, [2.0, 2.5, 3.0], 3)  # TTFT 1000 ms, TPOT (2000 - 1000) / 2 = 500 ms
    one = done(0.0, [0.2], 1)  # one token: no TPOT, no ITL
    failed = RequestOutput(128, error="HTTP 500")
    figures = serve_metrics([fast, slow, one, failed], 4.0, {"ttft": 500, "tpot": 200})

    assert (figures["completed"], figures["failed"]) == (3, 1)
    assert (figures["input_tokens"], figures["output_tokens"]) == (384, 9)
    assert figures["output_tokens_per_s"] == pytest.approx(9 / 4)
    assert figures["requests_per_s"] == pytest.approx(3 / 4)
    assert figures["goodput_rps"] == pytest.approx(2 / 4)  # slow misses both SLOs; one counts as TPOT 0
    assert figures["ttft_p50_ms"] == pytest.approx(200)  # of 100, 200, 1000
    assert figures["ttft_p99_ms"] == pytest.approx(200 + 800 * 0.98)  # linear interpolation
    assert figures["tpot_p50_ms"] == pytest.approx(300)  # of 100 and 500 only
    assert figures["itl_p50_ms"] == pytest.approx(100)  # pooled: 100 x 4, 500 x 2
    assert figures["itl_p90_ms"] == pytest.approx(500)
    assert figures["e2el_p50_ms"] == pytest.approx(500)  # of 500, 2000 and 200
    assert serve_metrics([fast], 1.0, {})["goodput_rps"] is None


def test_no_answer_gives_empty_percentiles_not_an_error():
    figures = serve_metrics([RequestOutput(128, error="refused")], 2.0, {"e2el": 1000})
    assert (figures["completed"], figures["failed"], figures["goodput_rps"]) == (0, 1, 0.0)
    assert figures["ttft_p50_ms"] is None and figures["itl_p99_ms"] is None


def test_goodput_slos_in_vllms_shape():
    assert parse_goodput(["ttft:2000", "tpot:150", "e2el:30000.5"]) == {"ttft": 2000, "tpot": 150, "e2el": 30000.5}
    assert parse_goodput([]) == {}
    for bad in ("itl:100", "ttft=200", "tpot:-1", "ttft:fast"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


def test_random_prompts_are_the_requested_length_and_fixed_by_the_seed(tokenizer: Any):
    prompts = random_prompts(tokenizer, 6, 128, seed=0)
    assert [len(tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts] == [128] * 6
    assert [p.tokens for p in prompts] == [128] * 6
    assert len({p.text for p in prompts}) == 6
    assert random_prompts(tokenizer, 3, 128, seed=0) == prompts[:3]  # a level uses the first N of the same list
    other = random_prompts(tokenizer, 6, 128, seed=1)
    assert prompts_digest(other) != prompts_digest(prompts) == prompts_digest(random_prompts(tokenizer, 6, 128, 0))
    special = set(tokenizer.all_special_ids)
    assert not any(special & set(tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts)


def sse(*messages: Any) -> bytes:
    return b"".join(b"data: " + (m if isinstance(m, bytes) else json.dumps(m).encode()) + b"\n\n" for m in messages)


COMPLETION = sse({"choices": [{"text": "He"}], "usage": None}, {"choices": [{"text": ""}]},  # an empty piece counts
                 {"choices": [{"text": "llo", "finish_reason": "length"}]},
                 {"choices": [], "usage": {"completion_tokens": 3}}, b"[DONE]")
CHAT = sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},  # the role alone: no chunk
           {"choices": [{"delta": {"content": "Hi"}}]}, {"choices": [{"delta": {}}]},
           {"choices": [{"delta": {}, "finish_reason": "length"}]}, b"[DONE]")  # no usage: re-tokenized


async def canned(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt" if "prompt" in body else "messages"] in ("fail", [{"role": "user", "content": "fail"}]):
        return web.Response(status=500, text="boom")
    assert body["stream"] is True and body["max_tokens"] == 3 and body["temperature"] == 0
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if body.get("prompt") != "silent":
        for line in (COMPLETION if "prompt" in body else CHAT).split(b"\n\n")[:-1]:
            await response.write(line + b"\n\n")
            await asyncio.sleep(0.01)
    await response.write_eof()
    return response


def level(transport: str, prompts: list[str], concurrency: int = 2) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        app = web.Application()
        app.router.add_post("/v1/completions", canned)
        app.router.add_post("/v1/chat/completions", canned)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        server = Server("canned", None, Path("."), port,  # type: ignore[arg-type]  # no process: the client only
                        transport=transport, base_url=f"http://127.0.0.1:{port}", model="m")
        try:
            outputs, seconds = await run_level(server, [Prompt(p, 4) for p in prompts], concurrency, 3,
                                               lambda text: len(text) * 10, timeout_s=30)
        finally:
            await runner.cleanup()
        assert seconds > 0
        return outputs

    return asyncio.run(run())


def test_completion_chunks_timings_and_usage():
    ok, failed, silent = level("openai", ["a", "fail", "silent"])
    assert (ok.error, ok.chunks, ok.text, ok.output_tokens) == ("", 3, "Hello", 3)
    assert len(ok.itl) == 2 and all(gap > 0 for gap in ok.itl)
    assert 0 < ok.ttft < ok.latency
    assert ok.latency == pytest.approx(ok.ttft + sum(ok.itl))
    assert failed.error.startswith("RuntimeError: HTTP 500: boom") and failed.chunks == 0
    assert silent.error == "no chunk arrived"


def test_chat_skips_the_role_chunk_and_retokenizes_without_usage():
    (out,) = level("chat", ["a"], concurrency=1)
    assert (out.error, out.chunks, out.text) == ("", 3, "Hi")
    assert out.output_tokens == 20  # count_tokens("Hi"): the server sent no usage


def test_cpu_line_from_cpuinfo(tmp_path: Path):
    cpuinfo = tmp_path / "cpuinfo"
    entry = ("model name\t: Example CPU 9000\nphysical id\t: 0\ncore id\t: {core}\n"
             "flags\t\t: fpu avx2 avx512f amx_int8\n\n")
    cpuinfo.write_text("processor\t: 0\n" + entry.format(core=0) + "processor\t: 1\n" + entry.format(core=0)
                       + "processor\t: 2\n" + entry.format(core=1))
    info = cpu_info(cpuinfo)
    assert (info["model"], info["flags"], info["cores"]) == ("Example CPU 9000", ["avx2", "avx512f", "amx_int8"], 2)
    assert info["usable"] >= 1
    missing = cpu_info(tmp_path / "absent")
    assert (missing["model"], missing["flags"], missing["cores"]) == ("unknown", [], None)
