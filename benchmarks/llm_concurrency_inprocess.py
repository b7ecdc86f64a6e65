"""llm_concurrency.py's in-process systems, each in a child process of its own: ``hf_cb``
(transformers' continuous batching) and ``static`` (one left-padded ``model.generate``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import BENCH, peak_rss_mib, reset_peak_rss
from llm_concurrency_plan import HF_CB_CONFIG, Scenario, figures


def child_main(system: str) -> int:
    """Child process of ``hf_cb`` / ``static``: read ``{"scenarios", "max_new_tokens"}`` on stdin,
    measure them, print one JSON line ``{"results": {key: {"requests", "peak_rss_mib"}}}``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from inference_service.llm.generation import build_prompt_ids, model_context_length
    from inference_service.llm.model import load_model, prepare_gguf
    from inference_service.llm.params import GenerationParams
    from inference_service.llm.requests import GenerationRequest

    job = json.loads(sys.stdin.read())
    max_new_tokens = int(job["max_new_tokens"])
    torch.set_num_threads(os.cpu_count() or 1)  # as the servers' single worker
    model, tokenizer = load_model(prepare_gguf())
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    ctx = model_context_length(model)

    def ids_of(prompt: str) -> list[int]:
        return build_prompt_ids(tokenizer, GenerationRequest(prompt=prompt, messages=None, params=params), ctx)

    scenarios = [Scenario(**s) for s in job["scenarios"]]
    run = _static_runner(model, tokenizer) if system == "static" else _hf_cb_runner(model, job.get("hf_cb_config"))
    results: dict[str, Any] = {}
    try:
        warm = scenarios[0]
        run([ids_of(p) for p in warm.prompts[:2]], [0.0, 0.0][: len(warm.prompts[:2])], 4, "warmup")
        for sc in scenarios:
            reset_peak_rss(os.getpid())
            requests = run([ids_of(p) for p in sc.prompts], sc.offsets, max_new_tokens, sc.key)
            results[sc.key] = {"requests": requests, "peak_rss_mib": peak_rss_mib(os.getpid())}
    finally:
        close = getattr(run, "close", None)
        if close is not None:
            close()
    print(json.dumps({"results": results}))
    return 0


def _static_runner(model: Any, tokenizer: Any) -> Any:
    """``run(prompt_ids, offsets, max_new_tokens, tag)`` doing one left-padded ``model.generate``.

    Every request's messages are the generation steps (a StoppingCriteria stamps each); offsets are
    ignored (all requests start together)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    class Stamp(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def run(prompt_ids: list[list[int]], offsets: list[float], max_new_tokens: int, tag: str) -> list[dict[str, Any]]:
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        stamp = Stamp()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                 stopping_criteria=StoppingCriteriaList([stamp]))
        tokens = int(out.shape[1] - width)
        return [{"sent": start, "times": list(stamp.times), "tokens": tokens, "error": None} for _ in prompt_ids]

    return run


def _hf_cb_runner(model: Any, cb_config: dict[str, Any] | None) -> Any:
    """``run(prompt_ids, offsets, max_new_tokens, tag)`` on one started ContinuousBatchingManager.

    Requests are added at their offsets from this thread, which also drains the manager's output
    queue (stamping each streamed output); bounded by a deadline of 60 s + 1 s per token."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(**(cb_config or HF_CB_CONFIG)))
    manager.start()

    def run(prompt_ids: list[list[int]], offsets: list[float], max_new_tokens: int, tag: str) -> list[dict[str, Any]]:
        n = len(prompt_ids)
        records = [{"sent": 0.0, "times": [], "tokens": 0, "error": None} for _ in range(n)]
        index = {f"{tag}-{i}": i for i in range(n)}
        start = time.perf_counter()
        deadline = start + max(offsets) + 60 + n * max_new_tokens
        added, finished = 0, 0
        while finished < n:
            now = time.perf_counter()
            if now > deadline:
                for r in records:
                    r["error"] = r["error"] or "deadline"
                break
            while added < n and now - start >= offsets[added]:
                records[added]["sent"] = time.perf_counter()
                manager.add_request(prompt_ids[added], request_id=f"{tag}-{added}", max_new_tokens=max_new_tokens,
                                    streaming=True, eos_token_id=-1)
                added += 1
            wait = 0.05 if added == n else max(0.0, min(0.05, start + offsets[added] - time.perf_counter()))
            out = manager.get_result(timeout=wait) if wait > 0 else None
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            i = index.get(out.request_id)
            if i is None:
                continue
            rec = records[i]
            rec["times"].append(time.perf_counter())
            rec["tokens"] = len(out.generated_tokens)
            if out.error:
                rec["error"] = str(out.error)
            if out.is_finished():
                finished += 1
        return records

    def close() -> None:
        manager.stop(block=True, timeout=30)

    run.close = close  # type: ignore[attr-defined]
    return run


def run_child(system: str, scenarios: list[Scenario], max_new_tokens: int, workdir: Path) -> dict[str, Any]:
    """Run ``system`` (``hf_cb`` / ``static``) in a child process; its stderr goes to ``workdir/<system>.log``."""
    job = {"max_new_tokens": max_new_tokens, "hf_cb_config": HF_CB_CONFIG,
           "scenarios": [s.__dict__ for s in scenarios]}
    limit = 300 + sum(max(s.offsets) + 60 + s.n * max_new_tokens for s in scenarios)
    log_path = workdir / f"{system}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(BENCH / "llm_concurrency.py"), "--child", system],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        try:
            out, _ = proc.communicate(json.dumps(job).encode(), timeout=limit)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{system} child exited {proc.returncode}: {' | '.join(tail)}")
    results = json.loads(out.decode().strip().splitlines()[-1])["results"]
    return {key: {**figures(v["requests"]), "peak_rss_mib": v["peak_rss_mib"]} for key, v in results.items()}
