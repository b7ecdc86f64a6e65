"""A bounded soak: mixed traffic on an echo model and a tiny random Llama (torch engine), with
cancels, stalled readers, management calls and worker kills.

Runs ``INFERENCE_SERVICE_SOAK_S`` seconds (default 40; 600 for the 10-minute soak of issue 34).
Every request ends with exactly one terminal outcome (OK with the right answer, CANCELLED when
the client cancelled, or UNAVAILABLE when its worker was killed); the server's log holds no
traceback; the server's RSS grows less than 10 % after warm-up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import psutil
import pytest

from conftest import ROOT, BearerAuth, ServerProcess
from inference_service._proto import inference_pb2, inference_pb2_grpc

pytestmark = [pytest.mark.soak, pytest.mark.llm, pytest.mark.slow, pytest.mark.serial]

DURATION = float(os.environ.get("INFERENCE_SERVICE_SOAK_S", "40"))
THREADS = 6
# the traffic mix: kind i is drawn when the random draw is below KIND_BOUNDS[i]
KINDS = ("unary", "echo stream", "echo cancel", "llm stream", "llm cancel", "stalled reader")
KIND_BOUNDS = (0.3, 0.5, 0.6, 0.8, 0.9, 1.0)
LLM_TOKENS = 16  # a whole LLM stream
STALLED_TOKENS = 300  # a stalled reader's stream: beyond the worker's window and the buffers
# a client channel with a small HTTP/2 window: a client that stops reading stops the server's writes
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 256)]


def _llm_archive(store: Path, work: Path) -> None:
    """``llm.mar``: a tiny random Llama (the tokenizer of the default GGUF) on the torch engine,
    one worker, 4 places; a stream out of credit is preempted after 1 s (the default)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from inference_service.llm.model import converted_model_dir, find_default_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(converted_model_dir(find_default_gguf())), local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model_dir = work / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_llm_archive"), "--model-store", str(store),
                    "--model-path", str(model_dir), "--name", "llm", "--batch-size", "4", "--engine", "torch"],
                   check=True, timeout=600, capture_output=True)


def _llm_request(tokens: int, prompt: str) -> inference_pb2.PredictionsRequest:
    body = {"prompt": prompt, "max_new_tokens": tokens, "ignore_eos": True, "include_usage": True}
    return inference_pb2.PredictionsRequest(model_name="llm", input={"data": json.dumps(body).encode()})


def _llm_final(messages: list[bytes], tokens: int) -> str | None:
    """What is wrong with an LLM stream's messages (``None``: nothing)."""
    try:
        final = json.loads(messages[-1])
    except (IndexError, ValueError):
        return f"no final message: {messages[-1:]!r}"
    if final.get("finish_reason") != "length" or final.get("usage", {}).get("completion_tokens", tokens) != tokens:
        return f"final {final!r}"
    return None


@pytest.mark.timeout(DURATION + 600)  # setup, the soak, the drain
def test_soak(store, tmp_path):
    soak_store = tmp_path / "store"
    soak_store.mkdir()
    shutil.copy(store / "echo.mar", soak_store / "echo.mar")
    _llm_archive(soak_store, tmp_path)
    srv = ServerProcess(tmp_path / "work", soak_store,
                        ["--models", "echo=echo.mar", "llm=llm.mar", "--workers-per-model", "2"])
    outcomes: Counter[str] = Counter()
    wrong: list[str] = []
    lock = threading.Lock()
    warm_rss: list[int] = []
    done_kinds: Counter[str] = Counter()
    stalled_channel = grpc.insecure_channel(f"127.0.0.1:{srv.inference_port}", options=SMALL_WINDOW)
    stalled = inference_pb2_grpc.InferenceAPIsServiceStub(
        grpc.intercept_channel(stalled_channel, BearerAuth(srv.key_file, "inference")))
    try:
        srv.wait_workers("echo", 2)
        srv.wait_workers("llm", 1, timeout=120)
        server_proc = psutil.Process(srv.proc.pid)
        start = time.monotonic()  # the soak's clock starts once its workers are up

        def one(rng: random.Random, n: int) -> str:
            kind = rng.random()
            name = KINDS[next(i for i, bound in enumerate(KIND_BOUNDS) if kind < bound)]
            code = _one(rng, n, name)
            if code == "OK" or (code == "CANCELLED" and name.endswith("cancel")):  # it ended as it should
                with lock:
                    done_kinds[name] += 1
            return code

        def _one(rng: random.Random, n: int, name: str) -> str:
            try:
                if name == "unary":
                    body = f"soak-{n}".encode()
                    out = srv.inference.Predictions(
                        inference_pb2.PredictionsRequest(model_name="echo", input={"data": body}), timeout=60)
                    if out.prediction != body:
                        wrong.append(f"unary {body!r} -> {out.prediction!r}")
                    return "OK"
                if name == "echo stream":
                    got = [r.prediction for r in srv.inference.StreamPredictions(
                        inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"stream:3"}), timeout=60)]
                    if got != [b"part0;", b"part1;", b"part2;", b"end"]:
                        wrong.append(f"stream -> {got!r}")
                    return "OK"
                if name == "echo cancel":
                    call = srv.inference.StreamPredictions(
                        inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"stream:50:0.02"}),
                        timeout=60)
                    for i, _ in enumerate(call):
                        if i == 1:
                            call.cancel()
                    return "OK"  # finished before the cancel took effect
                if name == "llm stream":  # read to its end
                    got = [r.prediction for r in srv.inference.StreamPredictions(
                        _llm_request(LLM_TOKENS, f"soak {n}"), timeout=60)]
                    if (problem := _llm_final(got, LLM_TOKENS)) is not None:
                        wrong.append(f"llm stream: {problem}")
                    return "OK"
                if name == "llm cancel":  # cancelled after its second message
                    call = srv.inference.StreamPredictions(_llm_request(200, f"cancel {n}"), timeout=60)
                    for i, _ in enumerate(call):
                        if i == 1:
                            call.cancel()
                    return "OK"
                # a stalled reader: reads one message, stops reading past the preemption bound, reads on
                call = stalled.StreamPredictions(_llm_request(STALLED_TOKENS, f"stall {n}"), timeout=120)
                first = next(call).prediction
                time.sleep(rng.uniform(0.2, 2.0))  # the client not reading: the scenario itself
                got = [first] + [r.prediction for r in call]
                if (problem := _llm_final(got, STALLED_TOKENS)) is not None:
                    wrong.append(f"stalled llm stream: {problem}")
                return "OK"
            except grpc.RpcError as err:
                return err.code().name

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            n = seed * 1_000_000
            while time.monotonic() - start < DURATION:
                n += 1
                outcome = one(rng, n)
                with lock:
                    outcomes[outcome] += 1

        def management() -> None:
            workers = 2
            while time.monotonic() - start < DURATION:
                for name in ("echo", "llm"):
                    if not srv.describe(name):
                        wrong.append(f"describe {name}: empty")
                workers = 3 if workers == 2 else 2
                srv.scale("echo", workers)
                with lock:
                    outcomes["management"] += 1
                time.sleep(2.0)  # pacing of the management calls

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
        threads.append(threading.Thread(target=management, daemon=True))
        for t in threads:
            t.start()
        time.sleep(min(10.0, DURATION / 4))  # warm-up phase of the soak (not a synchronisation point)
        warm_rss.append(server_proc.memory_info().rss)
        kills = 0
        while time.monotonic() - start < DURATION - 5:  # a worker of each model killed every ~30 s
            for name in ("echo", "llm"):
                live = [w["pid"] for w in srv.describe(name)[0]["workers"] if w.get("pid")]
                if live:
                    os.kill(random.choice(live), signal.SIGKILL)
                    kills += 1
            time.sleep(min(30.0, DURATION / 4))  # pacing of the kills
        for t in threads:
            t.join(DURATION + 120)
        assert not any(t.is_alive() for t in threads), "a request never ended"
        srv.wait_workers("llm", 1, timeout=120)
        end_rss = server_proc.memory_info().rss
        log_text = srv.log()
    finally:
        stalled_channel.close()
        assert srv.stop() == 0
    print(f"soak {DURATION:g} s: {dict(outcomes)}, by kind {dict(done_kinds)}, {kills} worker kills, server RSS "
          f"{warm_rss[0] / 2**20:.1f} -> {end_rss / 2**20:.1f} MiB")
    assert wrong == []
    assert set(outcomes) <= {"OK", "CANCELLED", "UNAVAILABLE", "management"}, outcomes
    # bounds on what happened, not on how fast: every kind of traffic ended well at least once,
    # each thread finished several requests, cancels reached the server, workers were killed
    assert set(done_kinds) == set(KINDS), done_kinds
    assert outcomes["OK"] >= 3 * THREADS and outcomes["CANCELLED"] >= 1 and kills >= 2, outcomes
    assert "Traceback" not in log_text, log_text[log_text.index("Traceback") - 2000:][:6000]
    assert end_rss < warm_rss[0] * 1.10, (warm_rss[0], end_rss)
