"""Chaos: the server keeps its promises while everything goes wrong at once.

Client threads keep unary (Predictions) and streaming (StreamPredictions) requests going
against the echo model and a generator-handler streaming model, and cancel some streams
mid-way, while the test, round after round, SIGKILLs worker processes (children of the
server), sends requests the server must refuse (a 65,536-entry input map, a 70,000-byte
input name, an unknown model, an unknown version) and registers and unregisters an extra
model. Then:

- every request ended OK or with a code documented for its case (``ALLOWED``), and a
  request that failed because its worker was killed names the death;
- no more requests failed than the killed workers were running;
- a killed worker's model is served again within 5 s;
- the server's resident memory grew by at most 20 MB after a warm-up round;
- the server is alive and healthy, with every worker back, its queues empty and every
  model answering.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ServerProcess, build_mar, wait_for
from inference_service._proto import inference_pb2, management_pb2

pytestmark = pytest.mark.soak

ECHO, STREAM, EXTRA = "echo", "chaos_steps", "chaos_extra"
WORKERS = 2  # per startup model
ROUNDS = 5
SERVED_AGAIN_S = 5.0
RSS_GROWTH_LIMIT = 20 * 1024 * 1024
U = grpc.StatusCode
# What each kind of request may end with (docs/observability.md, "Error details"). A killed worker's
# requests get UNAVAILABLE (WORKER_DIED); nothing here may hang (DEADLINE_EXCEEDED) or
# fill a queue (RESOURCE_EXHAUSTED): the load is a few requests at a time.
ALLOWED: dict[str, set[grpc.StatusCode]] = {
    "unary": {U.OK, U.UNAVAILABLE},
    "stream": {U.OK, U.UNAVAILABLE},
    "cancelled": {U.CANCELLED, U.UNAVAILABLE},
    "too many inputs": {U.INVALID_ARGUMENT},
    "long input name": {U.INVALID_ARGUMENT},
    "unknown model": {U.NOT_FOUND},
    "unknown version": {U.NOT_FOUND},
    "management": {U.OK},
}


@dataclass
class Outcome:
    kind: str
    model: str
    code: grpc.StatusCode
    details: str = ""
    wrong: str = ""  # an OK answer that is not the expected one


@dataclass
class Ledger:
    """Every request's outcome, appended from the client threads."""
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def codes(self) -> Counter[tuple[str, str]]:
        with self.lock:
            return Counter((o.kind, o.code.name) for o in self.outcomes)


@pytest.fixture(scope="module")
def csrv(store: Path, tmp_path_factory: pytest.TempPathFactory):
    build_mar(store, STREAM, "gen_steps_handler.py")
    build_mar(store, EXTRA, "echo_handler.py")
    srv = ServerProcess(tmp_path_factory.mktemp("chaos"), store,
                        ["--enable-model-api", "--models", f"{ECHO}=echo.mar,{STREAM}={STREAM}.mar",
                         "--workers-per-model", str(WORKERS)])
    try:
        srv.wait_workers(ECHO, WORKERS)
        srv.wait_workers(STREAM, WORKERS)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _request(model: str, body: bytes | str, **inputs: bytes) -> inference_pb2.PredictionsRequest:
    data = body.encode() if isinstance(body, str) else body
    return inference_pb2.PredictionsRequest(model_name=model, input={"data": data, **inputs})


def _steps(log: Path, steps: int, delay: float) -> bytes:
    return json.dumps({"steps": steps, "delay": delay, "log": str(log)}).encode()


class Load:
    """Client threads sending requests until ``stop``; each outcome goes to the ledger."""

    def __init__(self, srv: ServerProcess, ledger: Ledger, log: Path) -> None:
        self.srv, self.ledger, self.log = srv, ledger, log
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, name: str, one: Callable[[int], Outcome | list[Outcome]], count: int) -> None:
        for t in range(count):
            def loop(t: int = t) -> None:
                n = t * 1_000_000
                while not self.stop.is_set():
                    n += 1
                    outcome = one(n)
                    for o in outcome if isinstance(outcome, list) else [outcome]:
                        self.ledger.add(o)
            thread = threading.Thread(target=loop, name=f"{name}-{t}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self, timeout: float) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in self.threads if t.is_alive()]
        assert not hung, f"requests that never ended: {hung}"

    # --- one request of each kind ---------------------------------------------------------
    def unary(self, n: int) -> Outcome:
        body = f"chaos {n}".encode()
        try:
            got = self.srv.inference.Predictions(_request(ECHO, body), timeout=30).prediction
        except grpc.RpcError as err:
            return Outcome("unary", ECHO, err.code(), err.details() or "")
        return Outcome("unary", ECHO, U.OK, wrong="" if got == body else f"{body!r} -> {got!r}")

    def echo_stream(self, n: int) -> Outcome:
        return self._stream(ECHO, _request(ECHO, "stream:4:0.02"), [b"part0;", b"part1;", b"part2;", b"part3;"],
                            b"end")

    def steps_stream(self, n: int) -> Outcome:
        return self._stream(STREAM, _request(STREAM, _steps(self.log, 4, 0.02)), [b"step0", b"step1", b"step2",
                                                                                  b"step3"], None)

    def _stream(self, model: str, req: inference_pb2.PredictionsRequest, head: list[bytes],
                last: bytes | None) -> Outcome:
        got: list[bytes] = []
        try:
            for response in self.srv.inference.StreamPredictions(req, timeout=30):
                got.append(response.prediction)
        except grpc.RpcError as err:
            return Outcome("stream", model, err.code(), err.details() or "")
        # the generator handler's last message is its worker's pid
        ok = got[:-1] == head and (got[-1] == last if last is not None else got[-1].isdigit())
        return Outcome("stream", model, U.OK, wrong="" if ok else repr(got))

    def cancelled_stream(self, n: int) -> Outcome:
        model = ECHO if n % 2 else STREAM
        body = "stream:200:0.02" if model == ECHO else _steps(self.log, 200, 0.02)
        call = self.srv.inference.StreamPredictions(_request(model, body), timeout=30)
        try:
            next(call)
            call.cancel()
            for _ in call:
                pass
        except grpc.RpcError as err:
            return Outcome("cancelled", model, err.code(), err.details() or "")
        return Outcome("cancelled", model, U.OK, wrong="a 200-step stream ended before its cancel")

    def refusals(self, n: int) -> list[Outcome]:
        """Each of BAD_REQUESTS through Predictions and StreamPredictions."""
        srv, outcomes = self.srv, []
        for kind, model, req, text in BAD_REQUESTS:
            for call in (srv.inference.Predictions, lambda r, timeout: list(srv.inference.StreamPredictions(
                    r, timeout=timeout))):
                try:
                    call(req, timeout=30)
                except grpc.RpcError as err:
                    details = err.details() or ""
                    outcomes.append(Outcome(kind, model, err.code(), details, "" if text in details else details))
                else:
                    outcomes.append(Outcome(kind, model, U.OK))
        return outcomes


# --- the refusals and the management churn ----------------------------------------------
BAD_REQUESTS = [
    ("too many inputs", ECHO, _request(ECHO, b"x", **{f"k{i}": b"" for i in range(65_535)}),
     "at most 65535"),  # 65,536 entries with "data"
    ("long input name", ECHO, _request(ECHO, b"x", **{"n" * 70_000: b""}), "longer than 65534 bytes"),
    ("unknown model", "chaos_nope", _request("chaos_nope", b"x"), ""),
    ("unknown version", ECHO, inference_pb2.PredictionsRequest(model_name=ECHO, model_version="9.9",
                                                               input={"data": b"x"}), ""),
]


def _churn(srv: ServerProcess, ledger: Ledger) -> None:
    """Register the extra model, use it, unregister it (each step's status to the ledger)."""
    def step(fn: Callable[[], object]) -> None:
        try:
            fn()
        except grpc.RpcError as err:
            ledger.add(Outcome("management", EXTRA, err.code(), err.details() or ""))
        else:
            ledger.add(Outcome("management", EXTRA, U.OK))

    step(lambda: srv.register(f"{EXTRA}.mar", initial_workers=1, timeout=60))
    step(lambda: srv.predict(EXTRA, "extra", timeout=30))
    step(lambda: srv.unregister(EXTRA))


# --- workers -----------------------------------------------------------------------------
def _worker_pids(srv: ServerProcess, model: str) -> list[int]:
    """The model's running workers, each checked to be a child process of the server."""
    children = {p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)}
    pids = [w["pid"] for w in srv.describe(model)[0]["workers"] if w["pid"] > 0]
    assert set(pids) <= children, (pids, children)
    return pids


def _kill(pids: list[int]) -> float:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def _served_again(srv: ServerProcess, model: str, killed: list[int], killed_at: float, log: Path) -> None:
    """Within SERVED_AGAIN_S of the kill: the model answers, and is back to WORKERS workers
    none of which is a killed one."""
    deadline = killed_at + SERVED_AGAIN_S
    body = _steps(log, 1, 0) if model == STREAM else b"again"

    def answers() -> bool:
        try:
            srv.inference.Predictions(_request(model, body), timeout=max(0.1, deadline - time.monotonic()))
        except grpc.RpcError as err:
            assert err.code() in (U.UNAVAILABLE, U.DEADLINE_EXCEEDED), err
            return False
        return True

    def restored() -> bool:
        workers = srv.describe(model)[0]["workers"]
        ready = [w["pid"] for w in workers if w["status"] in ("READY", "BUSY") and w["pid"] > 0]
        return len(ready) == WORKERS and not set(ready) & set(killed)

    wait_for(answers, max(0.0, deadline - time.monotonic()), 0.05, f"{model} answers after its workers were killed")
    wait_for(restored, max(0.0, deadline - time.monotonic()), 0.05, f"{model} has {WORKERS} new workers")


def _rss(srv: ServerProcess) -> int:
    return psutil.Process(srv.proc.pid).memory_info().rss


class MemoryGrowth(AssertionError):
    """The server's resident memory grew by more than RSS_GROWTH_LIMIT."""


def test_chaos(csrv, tmp_path):
    ledger = Ledger()
    log = tmp_path / "steps.log"
    load = Load(csrv, ledger, log)
    # warm-up: a few of everything (the allocator keeps its high-water mark of the large
    # refused requests: what grows beyond it is kept per request), then the memory baseline
    for outcome in (load.unary(0), load.echo_stream(0), load.steps_stream(0), load.cancelled_stream(0),
                    load.cancelled_stream(1)):
        ledger.add(outcome)
    for n in range(8):
        for outcome in load.refusals(n):
            ledger.add(outcome)
    _churn(csrv, ledger)
    baseline = _rss(csrv)

    load.start("unary", load.unary, 3)
    load.start("echo-stream", load.echo_stream, 1)
    load.start("steps-stream", load.steps_stream, 2)
    load.start("cancel", load.cancelled_stream, 1)
    load.start("refuse", load.refusals, 1)
    kills: Counter[str] = Counter()
    started = time.monotonic()
    try:
        wait_for(lambda: ledger.codes()[("unary", "OK")] > 10, 30, 0.05, "load running")
        for _ in range(ROUNDS):
            # one echo worker, mid-request most likely (the other keeps serving)
            victim = _worker_pids(csrv, ECHO)[:1]
            _served_again(csrv, ECHO, victim, _kill(victim), log)
            kills[ECHO] += 1
            _churn(csrv, ledger)
            # every worker of the streaming model, mid-stream
            victims = _worker_pids(csrv, STREAM)
            _served_again(csrv, STREAM, victims, _kill(victims), log)
            kills[STREAM] += len(victims)
    finally:
        load.join(60)
    chaos_s = time.monotonic() - started

    # every request ended with a code documented for its case
    unexpected = [o for o in ledger.outcomes if o.code not in ALLOWED[o.kind]]
    assert not unexpected, unexpected[:10]
    wrong = [o for o in ledger.outcomes if o.wrong]
    assert not wrong, wrong[:10]
    # only the killed workers' requests failed, and they say why
    failed = [o for o in ledger.outcomes if o.code == U.UNAVAILABLE]
    assert all("died" in o.details for o in failed), failed[:10]
    for model in (ECHO, STREAM):
        per_model = [o for o in failed if o.model == model]
        assert len(per_model) <= kills[model], (model, kills[model], per_model)
    codes = ledger.codes()
    assert codes[("unary", "OK")] > 20 and codes[("stream", "OK")] > 10 and codes[("cancelled", "CANCELLED")] > 2, \
        codes
    refused = Counter(o.kind for o in ledger.outcomes if o.kind in {kind for kind, *_ in BAD_REQUESTS})
    assert len(refused) == len(BAD_REQUESTS) and min(refused.values()) >= 2, refused

    # the server is whole again
    assert csrv.proc.poll() is None
    for model in (ECHO, STREAM):
        csrv.wait_described(model, lambda d: (len([w for w in d["workers"] if w["status"] == "READY"]) == WORKERS
                                              and d["jobQueueStatus"]["pendingRequests"] == 0), 30,
                            f"{model}: {WORKERS} idle workers and an empty queue")
    assert csrv.predict(ECHO, "after") == b"after"
    assert csrv.stream(STREAM, _steps(log, 2, 0))[:2] == [b"step0", b"step1"]
    listed = json.loads(csrv.management.ListModels(management_pb2.ListModelsRequest(), timeout=10).msg)["models"]
    assert sorted(m["modelName"] for m in listed) == sorted([ECHO, STREAM])
    assert "Healthy" in csrv.inference.Ping(empty_pb2.Empty(), timeout=5).health
    health = health_pb2_grpc.HealthStub(csrv.channel)
    for service in ("", f"model/{ECHO}", f"model/{STREAM}"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING, service
    grown = _rss(csrv) - baseline
    if grown > RSS_GROWTH_LIMIT:
        raise MemoryGrowth(f"server RSS grew by {grown / 2**20:.1f} MiB in {chaos_s:.0f} s of chaos "
                           f"({sum(codes.values())} requests)")
