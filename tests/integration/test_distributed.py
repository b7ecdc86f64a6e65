"""torchrun-launched worker groups: every request reaches all ranks, rank 0 answers once."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import torch

from conftest import ServerProcess, build_mar
from inference_service._proto import inference_pb2

X = [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [0.5, -1.0, 0.0, 2.0, 1.0, 1.0, -3.0, 0.25]]


@pytest.fixture(scope="module")
def tp_server(store, tmp_path_factory):
    (store / "tp.yaml").write_text("parallelType: tp\ntorchrun:\n  nproc-per-node: 2\n  OMP_NUMBER_THREADS: 1\n"
                                   "minWorkers: 1\nmaxWorkers: 1\nstartupTimeout: 120\n")
    build_mar(store, "tp", "tp_handler.py", config=str(store / "tp.yaml"))
    srv = ServerProcess(tmp_path_factory.mktemp("tp"), store, ["--models", "tp=tp.mar"])
    srv.wait_workers("tp", 1, timeout=120)
    yield srv
    assert srv.stop() == 0


def _expected(steps: int) -> list[list[list[float]]]:
    torch.manual_seed(0)
    weight = torch.randn(8, 6)
    x = torch.tensor(X)
    return [((x * (s + 1)) @ weight).tolist() for s in range(steps)]


def test_two_ranks_stream_once_and_match_single_process(tp_server):
    body = json.dumps({"x": X, "steps": 3}).encode()
    responses = [json.loads(r.prediction) for r in tp_server.inference.StreamPredictions(
        inference_pb2.PredictionsRequest(model_name="tp", input={"data": body}), timeout=60)]
    assert [r["step"] for r in responses[:-1]] == [0, 1, 2]  # each intermediate exactly once, in order
    for got, want in zip(responses[:-1], _expected(3), strict=True):
        assert torch.allclose(torch.tensor(got["y"]), torch.tensor(want), atol=1e-5)
    final = responses[-1]
    assert final["world_size"] == 2
    ranks = sorted(final["ranks"], key=lambda r: r["rank"])
    assert [r["local_rank"] for r in ranks] == ["0", "1"]
    assert all(r["master_addr"] == "127.0.0.1" and r["omp"] == "1" for r in ranks)
    assert ranks[0]["pid"] != ranks[1]["pid"]
    # DescribeModel shows the group as one worker whose pid is rank 0's
    assert tp_server.describe("tp")[0]["workers"][0]["pid"] == ranks[0]["pid"]
    # unary on the same group: one answer (intermediates concatenated with the final)
    unary = tp_server.predict("tp", json.dumps({"x": X, "steps": 1}))
    assert unary.count(b'"step"') == 1 and unary.count(b"world_size") == 1


def test_rendezvous_listens_on_loopback_only(tp_server):
    launcher = psutil.Process(tp_server.describe("tp")[0]["workers"][0]["pid"]).parent()
    group = [launcher, *launcher.children(recursive=True)]
    listening = [c.laddr for p in group for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening
    assert all(addr.ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for addr in listening), listening


def test_a_dead_rank_restarts_the_group(tp_server):
    rank0 = tp_server.describe("tp")[0]["workers"][0]["pid"]
    launcher = psutil.Process(rank0).parent()
    ranks = [p for p in launcher.children() if p.pid != rank0]
    assert len(ranks) == 1
    os.kill(ranks[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        worker = tp_server.describe("tp")[0]["workers"][0]
        if worker["status"] == "READY" and worker["pid"] not in (rank0, -1):
            break
        assert time.monotonic() < deadline, worker
        time.sleep(0.2)
    assert worker["restarts"] == 1
    assert not psutil.pid_exists(rank0) or psutil.Process(rank0).status() == psutil.STATUS_ZOMBIE
    body = json.dumps({"x": X, "steps": 1}).encode()
    out = [json.loads(r.prediction) for r in tp_server.inference.StreamPredictions(
        inference_pb2.PredictionsRequest(model_name="tp", input={"data": body}), timeout=60)]
    assert torch.allclose(torch.tensor(out[0]["y"]), torch.tensor(_expected(1)[0]), atol=1e-5)
