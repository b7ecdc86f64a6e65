"""The Prometheus endpoint of a real server after real traffic: exact counts, TorchServe's names."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import empty_pb2

from conftest import ROOT, ServerProcess, build_mar, wait_for
from inference_service._proto import inference_pb2

LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(srv: ServerProcess, query: str = "") -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``{(sample name, labels): value}`` of the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.status['metrics_port']}/metrics{query}", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = LINE.match(line)
        assert match is not None, line
        labels = frozenset(LABEL.findall(match.group(2) or ""))
        samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    """The sample ``name`` whose labels include ``labels`` (0 when absent; exactly one may match)."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0


@pytest.fixture(scope="module")
def msrv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """echo (2 workers) with handler metrics forwarded to /metrics; ``mh`` archived for registering."""
    build_mar(store, "mh", "metrics_handler.py")
    srv = ServerProcess(tmp_path_factory.mktemp("metrics"), store,
                        ["--enable-model-api", "--models", "echo=echo.mar", "--workers-per-model", "2",
                         "--metrics-mode", "prometheus"])
    try:
        srv.wait_workers("echo", 2)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def _req(body: str, model: str = "echo", version: str = "") -> inference_pb2.PredictionsRequest:
    return inference_pb2.PredictionsRequest(model_name=model, model_version=version, input={"data": body.encode()})


def test_endpoint_serves_prometheus_text_and_filters_by_name(msrv):
    assert msrv.status["metrics_port"] > 0 and msrv.status["metrics_address"] == "127.0.0.1"
    assert f"metrics API listening on http://127.0.0.1:{msrv.status['metrics_port']}/metrics" in msrv.log()
    assert msrv.predict("echo", "x") == b"x"
    only = scrape(msrv, "?name[]=ts_inference_requests_total&name[]=inference_service_workers")
    assert {name for name, _ in only} == {"ts_inference_requests_total", "inference_service_workers"}
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{msrv.status['metrics_port']}/nothing", timeout=10)
    assert err.value.code == 404


def test_exact_counts_after_known_traffic(msrv):
    before = scrape(msrv)
    for _ in range(4):
        assert msrv.predict("echo", "hi") == b"hi"
    for _ in range(2):
        assert msrv.predict("echo", "hi", version="1.0") == b"hi"
    for _ in range(3):
        assert msrv.stream("echo", "stream:2") == [b"part0;", b"part1;", b"end"]
    with pytest.raises(grpc.RpcError) as err:
        msrv.predict("echo", "boom")
    assert err.value.code() == grpc.StatusCode.INTERNAL
    with pytest.raises(grpc.RpcError) as err:
        msrv.predict("nope", "x")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    msrv.inference.Ping(empty_pb2.Empty(), timeout=10)
    after = scrape(msrv)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    default = {"model_name": "echo", "model_version": "1.0"}
    # TorchServe's counters: requests received for a registered model, by the version that served
    # them (one label per version: a request naming none counts for the default version, 1.0)
    assert delta("ts_inference_requests_total", **default) == 4 + 2 + 3 + 1
    assert not [k for k in after if ("model_version", "default") in k[1]]
    assert not [k for k in after if ("model_name", "nope") in k[1]]  # unknown models are not labels
    host = next(dict(ls)["hostname"] for n, ls in after if n == "ts_inference_requests_total")
    assert host and value(after, "ts_inference_requests_total", hostname=host, **default) > 0
    # latencies are totals in microseconds: each request took more than 1 µs and less than 10 s
    assert 9 < delta("ts_inference_latency_microseconds", **default) < 9 * 10e6
    assert 0 < delta("ts_queue_latency_microseconds", **default) <= delta("ts_inference_latency_microseconds",
                                                                          **default) + 1e6
    # streams: 3 messages each; one time-to-first-response and two gaps per stream
    assert delta("inference_service_stream_messages_total", **default) == 9
    assert delta("inference_service_time_to_first_response_seconds_count", **default) == 3
    assert delta("inference_service_response_gap_seconds_count", **default) == 6
    assert delta("inference_service_time_to_first_response_seconds_bucket", le="+Inf", **default) == 3
    assert 0 < delta("inference_service_time_to_first_response_seconds_sum", **default) < 30
    # errors by status code and reason; successful RPCs (Ping included) are not errors
    assert delta("inference_service_errors_total", method="Predictions", code="INTERNAL",
                 reason="HANDLER_ERROR") == 1
    assert delta("inference_service_errors_total", method="Predictions", code="NOT_FOUND",
                 reason="MODEL_NOT_FOUND") == 1
    assert sum(v for (n, _), v in after.items() if n == "inference_service_errors_total") - sum(
        v for (n, _), v in before.items() if n == "inference_service_errors_total") == 2
    assert delta("inference_service_cancellations_total", **default) == 0


def test_torchserve_requests_by_status_class(msrv):
    """Issue 49 item 6: TorchServe's frontend counters of HTTP answers, Requests2XX/4XX/5XX with its
    labels, counting the inference and management APIs' answers (a 401 and a 404 among them)."""
    import http.client

    from conftest import read_key

    def call(port_key: str, path: str, key: str | None, body: bytes | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", msrv.status[port_key], timeout=30)
        try:
            conn.request("POST" if body is not None else "GET", path, body=body,
                         headers={"Authorization": f"Bearer {key}"} if key else {})
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()

    def counts() -> list[float]:
        samples = scrape(msrv)
        return [value(samples, f"Requests{c}XX", Level="Host") for c in "245"]

    before = counts()
    inference = read_key(msrv.key_file, "inference")
    statuses = [call("http_port", "/ping", inference), call("http_port", "/predictions/echo", inference, b"ok"),
                call("http_management_port", "/models", read_key(msrv.key_file, "management")),
                call("http_port", "/predictions/nope", inference, b"x"), call("http_port", "/ping", None),
                call("http_port", "/predictions/echo", inference, b"boom")]
    assert statuses == [200, 200, 200, 404, 401, 503], statuses
    assert [a - b for a, b in zip(counts(), before, strict=True)] == [3, 2, 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{msrv.status['metrics_port']}/metrics", timeout=10).read()
    assert b"# TYPE Requests2XX counter\n" in text
    assert re.search(rb'\nRequests2XX\{Level="Host",Hostname="[^"]+"\} ', text)


def test_cancel_and_deadline_are_counted(msrv):
    before = scrape(msrv)
    call = msrv.inference.StreamPredictions(_req("stream:200:0.05", version="1.0"), timeout=30)
    assert next(call).prediction == b"part0;"
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        msrv.inference.Predictions(_req("sleep:0.6"), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def delta(name: str, **labels: str) -> float:
        return value(scrape(msrv), name, **labels) - value(before, name, **labels)

    wait_for(lambda: delta("inference_service_cancellations_total", model_name="echo", model_version="1.0") == 2)
    after = scrape(msrv)
    assert value(after, "inference_service_errors_total", method="StreamPredictions", code="CANCELLED") - value(
        before, "inference_service_errors_total", method="StreamPredictions", code="CANCELLED") == 1
    assert value(after, "inference_service_errors_total", method="Predictions", code="DEADLINE_EXCEEDED") - value(
        before, "inference_service_errors_total", method="Predictions", code="DEADLINE_EXCEEDED") == 1
    # the cancelled stream got at least its first message out, and no successful latency
    v10 = {"model_name": "echo", "model_version": "1.0"}
    assert value(after, "inference_service_stream_messages_total", **v10) - value(
        before, "inference_service_stream_messages_total", **v10) >= 1
    assert value(after, "ts_inference_latency_microseconds", **v10) == value(
        before, "ts_inference_latency_microseconds", **v10)
    wait_for(lambda: value(scrape(msrv), "inference_service_requests_in_flight") == 0)
    msrv.wait_workers("echo", 2)


def test_workers_queue_depth_and_restarts(msrv):
    labels = {"model_name": "echo", "model_version": "1.0"}
    msrv.wait_workers("echo", 2)  # a request of an earlier test may still hold one
    now = scrape(msrv)
    assert value(now, "inference_service_workers", state="READY", **labels) == 2
    assert value(now, "inference_service_workers", state="FAILED", **labels) == 0
    assert value(now, "inference_service_job_queue_depth", **labels) == 0
    restarts = value(now, "inference_service_worker_restarts_total", **labels)
    died = value(now, "inference_service_errors_total", code="UNAVAILABLE", reason="WORKER_DIED")
    with pytest.raises(grpc.RpcError) as err:
        msrv.predict("echo", "exit")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_for(lambda: value(scrape(msrv), "inference_service_worker_restarts_total", **labels) == restarts + 1)
    wait_for(lambda: value(scrape(msrv), "inference_service_workers", state="READY", **labels) == 2)
    assert value(scrape(msrv), "inference_service_errors_total", code="UNAVAILABLE", reason="WORKER_DIED") == died + 1


def test_handler_metrics_reach_the_endpoint(msrv):
    msrv.register("mh.mar", initial_workers=1)
    try:
        for _ in range(3):
            assert msrv.predict("mh", "abcd") == b"abcd"
        assert msrv.stream("mh", "stream:2") == [b"step0", b"step1", b"stream:2"]
        samples = scrape(msrv)
        dims = {"ModelName": "mh", "Level": "Model"}
        # counters as prometheus_client writes them (<name>_total), gauges and histograms by name
        assert value(samples, "LoadCount_total", **dims) == 1  # recorded in initialize(), before READY
        assert value(samples, "EchoRequests_total", kind="plain", **dims) == 3
        assert value(samples, "EchoRequests_total", kind="stream", **dims) == 1
        assert value(samples, "StreamSteps_total", **dims) == 2
        assert value(samples, "LastBatchSize", **dims) == 1
        assert value(samples, "PayloadBytes_count", **dims) == 4
        assert value(samples, "PayloadBytes_sum", **dims) == 3 * 4 + len("stream:2")
        assert value(samples, "PayloadBytes_bucket", le="+Inf", **dims) == 4
        assert all(dict(ls).get("Hostname") for n, ls in samples if n == "EchoRequests_total")
        only = scrape(msrv, "?name[]=EchoRequests&name[]=PayloadBytes")
        assert {name for name, _ in only} == {"EchoRequests_total", "EchoRequests_created", "PayloadBytes_bucket",
                                             "PayloadBytes_count", "PayloadBytes_sum", "PayloadBytes_created"}
        assert "EchoRequests.Count" not in msrv.log()  # prometheus mode: exported, not logged
    finally:
        msrv.unregister("mh")


def test_metrics_port_conflict_fails_startup_and_api_can_be_off(msrv, store, tmp_path):
    taken = msrv.status["metrics_port"]
    proc = subprocess.run([sys.executable, "-m", "inference_service", "--foreground", "--ncs",
                           "--grpc-inference-port", "0", "--grpc-management-port", "0", "--http-port", "0",
                           "--http-management-port", "0", "--metrics-port", str(taken), "--model-store", str(store)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1 and f"cannot bind the metrics API to 127.0.0.1:{taken}" in proc.stderr
    off = ServerProcess(tmp_path / "off", store, ["--disable-metrics-api"])
    try:
        assert off.status["metrics_port"] is None and off.status["metrics_address"] is None
        assert "metrics API listening" not in off.log()
        assert json.loads(off.inference.Ping(empty_pb2.Empty(), timeout=10).health)["status"] == "Healthy"
    finally:
        assert off.stop() == 0, off.log()


DASHBOARD = ROOT / "deploy" / "grafana" / "llm-dashboard.json"
METRIC_NAME = re.compile(r"\b(?:inference_service|ts)_[a-zA-Z0-9_]+")


@pytest.fixture(scope="module")
def llm_srv(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """llmstats (a handler reporting serving statistics, one worker) in the default metrics_mode (log)."""
    build_mar(store, "llmstats", "llm_stats_handler:handle")
    srv = ServerProcess(tmp_path_factory.mktemp("llm_metrics"), store,
                        ["--models", "llmstats=llmstats.mar", "--workers-per-model", "1"])
    try:
        srv.wait_workers("llmstats", 1)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


def test_llm_metrics_in_the_default_log_mode(llm_srv):
    """Serving statistics reach /metrics without metrics_mode prometheus; the histograms are
    measured per streamed message (the final message left out of the inter-token latency)."""
    assert llm_srv.stream("llmstats", "4") == [b"t0 ", b"t1 ", b"t2 ", b"t3 ", b""]
    assert llm_srv.predict("llmstats", "2") == b"t0 t1 "

    def settled() -> dict | None:
        samples = scrape(llm_srv)
        return samples if value(samples, "inference_service_llm_generation_tokens_total") == 6 else None

    samples = wait_for(settled, timeout=10)
    labels = {"model_name": "llmstats", "model_version": "1.0"}
    assert value(samples, "inference_service_llm_prompt_tokens_total", **labels) == 10
    assert value(samples, "inference_service_llm_num_requests_running", **labels) == 0
    assert value(samples, "inference_service_llm_kv_cache_used_tokens", **labels) == 20
    assert value(samples, "inference_service_llm_kv_cache_capacity_tokens", **labels) == 1000
    assert value(samples, "inference_service_llm_kv_cache_usage_perc", **labels) == pytest.approx(0.02)
    assert value(samples, "inference_service_llm_num_preemptions_total", **labels) == 0
    # the routing gauges the Inference Extension's endpoint picker reads, per model
    assert value(samples, "vllm:num_requests_waiting", model_name="llmstats") == 0
    assert value(samples, "vllm:num_requests_running", model_name="llmstats") == 0
    assert value(samples, "vllm:kv_cache_usage_perc", model_name="llmstats") == pytest.approx(0.02)
    assert value(samples, "vllm:cache_config_info", model_name="llmstats", block_size="16", num_gpu_blocks="62") == 1
    request = labels  # the request named no version: the label is the version that served it
    assert value(samples, "inference_service_llm_time_to_first_token_seconds_count", **request) == 1
    assert value(samples, "inference_service_llm_inter_token_latency_seconds_count", **request) == 3
    assert value(samples, "inference_service_llm_e2e_request_latency_seconds_count", **request) == 2
    # a model that reports none has no LLM series
    llm_families = ("inference_service_llm_", "vllm:")
    assert not [n for n, ls in samples if n.startswith(llm_families) and ("model_name", "echo") in ls]
    log_text = llm_srv.log()
    assert "serving:" not in log_text  # no METRIC-frame name in the log
    assert "engine stats of llmstats: kv_cache_capacity_tokens=1000" in log_text  # the log metrics line


def test_dashboard_queries_name_exported_metrics(llm_srv):
    """Every query of the Grafana dashboard (panels and variables) names metrics this server exports."""
    assert llm_srv.stream("llmstats", "3")[-1] == b""
    with pytest.raises(grpc.RpcError) as err:  # a handler error: inference_service_errors_total has a sample
        llm_srv.predict("llmstats", "not a number")
    assert err.value.code() == grpc.StatusCode.INTERNAL
    exported = {name for name, _ in scrape(llm_srv)}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [(var["name"], var["definition"]) for var in dashboard["templating"]["list"] if var["type"] == "query"]
    assert len(exprs) >= 10
    for title, expr in exprs:
        names = METRIC_NAME.findall(expr)
        assert names, (title, expr)
        for name in names:
            assert name in exported, (title, name)
    assert {panel["title"] for panel in dashboard["panels"]} >= {
        "Tokens per second", "Time to first token", "Inter-token latency", "End-to-end request latency",
        "Requests running / waiting", "KV cache usage", "Preemptions per second"}
