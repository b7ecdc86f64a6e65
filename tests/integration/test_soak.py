"""A bounded soak: mixed unary and streaming traffic with cancels and a worker kill.

Runs ``INFERENCE_SERVICE_SOAK_S`` seconds (default 40; set it higher for a longer
soak). Every request ends with exactly one terminal outcome (OK with the right
answer, CANCELLED when the client cancelled, or UNAVAILABLE when its worker was
killed); the server's RSS grows less than 10 % after warm-up.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter

import grpc
import psutil

from conftest import ServerProcess
from inference_service._proto import inference_pb2

DURATION = float(os.environ.get("INFERENCE_SERVICE_SOAK_S", "40"))
THREADS = 6


def test_soak(store, tmp_path):
    srv = ServerProcess(tmp_path, store, ["--models", "echo=echo.mar", "--workers-per-model", "2"])
    outcomes: Counter[str] = Counter()
    wrong: list[str] = []
    lock = threading.Lock()
    start = time.monotonic()
    warm_rss: list[int] = []
    try:
        srv.wait_workers("echo", 2)
        server_proc = psutil.Process(srv.proc.pid)

        def one(rng: random.Random, n: int) -> str:
            kind = rng.random()
            try:
                if kind < 0.5:
                    body = f"soak-{n}".encode()
                    out = srv.inference.Predictions(
                        inference_pb2.PredictionsRequest(model_name="echo", input={"data": body}), timeout=30)
                    if out.prediction != body:
                        wrong.append(f"unary {body!r} -> {out.prediction!r}")
                    return "OK"
                if kind < 0.85:
                    got = [r.prediction for r in srv.inference.StreamPredictions(
                        inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"stream:3"}), timeout=30)]
                    if got != [b"part0;", b"part1;", b"part2;", b"end"]:
                        wrong.append(f"stream -> {got!r}")
                    return "OK"
                call = srv.inference.StreamPredictions(
                    inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"stream:50:0.02"}), timeout=30)
                for i, _ in enumerate(call):
                    if i == 1:
                        call.cancel()
                return "OK"  # finished before the cancel took effect
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

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
        for t in threads:
            t.start()
        time.sleep(min(10.0, DURATION / 4))  # warm-up phase of the soak (not a synchronisation point)
        warm_rss.append(server_proc.memory_info().rss)
        victim = srv.describe("echo")[0]["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(DURATION + 60)
        assert not any(t.is_alive() for t in threads), "a request never ended"
        srv.wait_workers("echo", 2)
        end_rss = server_proc.memory_info().rss
    finally:
        assert srv.stop() == 0
    assert wrong == []
    assert set(outcomes) <= {"OK", "CANCELLED", "UNAVAILABLE"}, outcomes
    assert outcomes["OK"] > 100 and outcomes["CANCELLED"] > 5, outcomes
    assert end_rss < warm_rss[0] * 1.10, (warm_rss[0], end_rss)
