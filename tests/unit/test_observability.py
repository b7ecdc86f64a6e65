"""Unit tests of the observability pieces: settings, METRIC frames, the exposition, the JSON log format."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import grpc
import pytest

from inference_service.cli import build_parser, settings_from_args
from inference_service.config import ConfigError
from inference_service.contracts import wire
from inference_service.contracts.stats import VersionStats
from inference_service.handler.metrics import Dimension, Metrics, MetricTypes
from inference_service.observability.accesslog import JsonFormatter
from inference_service.observability.metrics import ServerMetrics


def _settings(tmp_path: Path, config: str, *args: str):
    path = tmp_path / "config.properties"
    path.write_text(config)
    return settings_from_args(build_parser().parse_args(["--ts-config", str(path), *args]))


def test_config_keys_and_flags(tmp_path):
    s = _settings(tmp_path, "metrics_address=http://0.0.0.0:9100\nmetrics_mode=prometheus\n"
                            "enable_access_log=false\nlog_format=json\nlog_level=warning\n")
    assert (s.metrics_address, s.metrics_port, s.metrics_mode) == ("0.0.0.0", 9100, "prometheus")
    assert (s.access_log, s.log_format, s.log_level, s.enable_metrics_api) == (False, "json", "WARNING", True)
    assert s.metrics_url == "http://0.0.0.0:9100"
    s = _settings(tmp_path, "metrics_address=http://[::1]:9100\nenable_metrics_api=false\n",
                  "--metrics-port", "0", "--log-format", "plain", "--log-level", "debug")
    assert (s.metrics_address, s.metrics_port, s.enable_metrics_api) == ("::1", 0, False)
    assert (s.log_format, s.log_level) == ("plain", "DEBUG")
    s = settings_from_args(build_parser().parse_args(["--no-access-log", "--disable-metrics-api",
                                                      "--metrics-address", "0.0.0.0"]))
    assert (s.access_log, s.enable_metrics_api, s.metrics_address, s.metrics_port) == (False, False, "0.0.0.0", 8082)
    for bad in ("metrics_address=https://127.0.0.1:8082", "metrics_address=unix:/tmp/m.sock",
                "metrics_mode=statsd", "log_format=xml", "log_level=loud", "enable_access_log=false\nlog_level="):
        with pytest.raises(ConfigError):
            _settings(tmp_path, bad + "\n")
    with pytest.raises(ConfigError, match="out of range"):
        settings_from_args(build_parser().parse_args(["--metrics-port", "70000"]))


def test_metric_frame_roundtrip_and_worker_queue():
    metrics = Metrics("m")
    metrics.add_counter("C", 2)  # not forwarding: logged, not queued
    assert metrics.drain() == []
    metrics.forward()
    metrics.add_counter("C", 1, dimensions=[Dimension("k", "v")])
    metrics.add_metric("G", 7, "Count", metric_type=MetricTypes.GAUGE)
    assert metrics.get_metric("C").value == 3 and metrics.get_metric("G", MetricTypes.GAUGE).value == 7
    updates = metrics.drain()
    assert updates == [("C", "counter", "Count", {"ModelName": "m", "Level": "Model", "k": "v"}, 1.0),
                       ("G", "gauge", "Count", {"ModelName": "m", "Level": "Model"}, 7.0)]
    assert metrics.drain() == []
    frame = wire.encode_metrics(updates)
    assert wire.HEADER.unpack_from(frame)[1] == wire.METRIC
    assert wire.decode_metrics(frame[wire.HEADER.size:]) == updates
    assert wire.decode_metrics(b'[["ok","gauge","u",{},1], ["bad"], 3]') == [("ok", "gauge", "u", {}, 1.0)]
    with pytest.raises(wire.ProtocolError):
        wire.decode_metrics(b"{not json")


def test_exposition_of_frontend_and_handler_metrics(caplog):
    m = ServerMetrics(hostname="h")
    stats = m.model("echo", "1.0")
    stats.requests += 2
    stats.latency_us += 1500.0
    assert m.model("echo", "1.0") is stats and m.model("echo", "2.0") is not stats
    m.error("Predictions", grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND")
    dims = {"ModelName": "m", "Level": "Model"}
    with caplog.at_level(logging.WARNING, logger="inference_service.observability.metrics"):
        m.handler_metrics("m", "1.0", [
            ("Hits", "counter", "Count", dims, 2.0), ("Hits", "counter", "Count", dims, 3.0),
            ("Hits", "counter", "Count", dims, -1.0),                      # counters never decrease: dropped
            ("Hits", "gauge", "Count", dims, 9.0),                         # type changed: dropped
            ("Hits", "counter", "Count", {"Other": "x"}, 1.0),             # dimension names changed: dropped
            ("Load", "gauge", "Percent", dims, 0.5), ("Load", "gauge", "Percent", dims, 0.25),
            ("Lat-ms", "histogram", "ms", dims, 0.02), ("Lat-ms", "histogram", "ms", dims, 20.0),
            ("ts_inference_requests_total", "counter", "Count", dims, 1.0),  # the server's name: dropped
            ("Odd", "summary", "Count", dims, 4.0),                        # unknown type: a gauge
        ])
        m.handler_metrics("m", "1.0", [("Hits", "counter", "Count", dims, -1.0)])  # warned once per cause
    assert len(caplog.records) == 4, [r.getMessage() for r in caplog.records]  # one per name and cause
    text = m.render().decode()
    assert "# TYPE ts_inference_latency_microseconds counter\n" in text  # TorchServe's name, no _total
    assert 'ts_inference_requests_total{model_name="echo",model_version="1.0",hostname="h"} 2.0\n' in text
    assert 'ts_inference_latency_microseconds{model_name="echo",model_version="1.0",hostname="h"} 1500.0' in text
    assert 'ts_inference_requests_total{model_name="echo",model_version="2.0",hostname="h"} 0.0' in text
    assert ('inference_service_errors_total{code="NOT_FOUND",method="Predictions",reason="MODEL_NOT_FOUND"} 1.0'
            in text)
    # prometheus_client objects: counters as <name>_total, labels in name order
    assert "# HELP Hits_total handler metric, unit: Count\n# TYPE Hits_total counter\n" in text
    assert 'Hits_total{Hostname="h",Level="Model",ModelName="m"} 5.0\n' in text
    assert 'Load{Hostname="h",Level="Model",ModelName="m"} 0.25\n' in text
    assert 'Odd{Hostname="h",Level="Model",ModelName="m"} 4.0\n' in text
    assert 'Lat_ms_bucket{Hostname="h",Level="Model",ModelName="m",le="0.025"} 1.0\n' in text
    assert 'Lat_ms_bucket{Hostname="h",Level="Model",ModelName="m",le="+Inf"} 2.0\n' in text
    assert 'Lat_ms_count{Hostname="h",Level="Model",ModelName="m"} 2.0\n' in text
    assert 'Lat_ms_sum{Hostname="h",Level="Model",ModelName="m"} 20.02\n' in text
    assert "ts_inference_requests_total_total" not in text
    only = m.render({"Hits", "inference_service_errors"}).decode()
    assert "Hits_total{" in only and "inference_service_errors_total{" in only
    assert "ts_inference" not in only and "Load{" not in only


def test_handler_metrics_that_cannot_be_exported_are_dropped(caplog):
    m = ServerMetrics(hostname="h")
    with caplog.at_level(logging.WARNING, logger="inference_service.observability.metrics"):
        m.handler_metrics("m", "1.0", [
            ("Lat", "histogram", "ms", {"le": "x"}, 1.0),            # ``le`` is the histogram's own label
            ("Dup", "gauge", "u", {"a-b": "1", "a_b": "2"}, 1.0),    # the same label once sanitised
            ("Host", "gauge", "u", {"Hostname": "x"}, 1.0),          # Hostname is added by the server
            ("Twin", "gauge", "u", {}, 1.0), ("Twin_total", "counter", "u", {}, 1.0),  # same series names
            ("1st:x", "gauge", "u", {"k:1": "v", "9k": "w"}, 2.0),   # names made Prometheus-safe
        ])
    assert len(caplog.records) == 4, [r.getMessage() for r in caplog.records]
    text = m.render().decode()
    assert 'Twin{Hostname="h"} 1.0\n' in text and "Twin_total" not in text
    assert '_1st:x{Hostname="h",_9k="w",k_1="v"} 2.0\n' in text
    assert "Lat_" not in text and "Dup{" not in text and "Host{" not in text


class _Source:
    def stats(self):
        return 3, [VersionStats(model_name="echo", model_version="1.0", queue_depth=2,
                                   workers={"READY": 1, "BUSY": 0}, restarts=4, worker_pids=frozenset())]


def test_scrape_reads_the_stats_view():
    m = ServerMetrics(hostname="h")
    text = m.render().decode()
    assert "inference_service_requests_in_flight" not in text  # no source attached yet
    m.attach(_Source())
    text = m.render().decode()
    assert "inference_service_requests_in_flight 3.0\n" in text
    assert 'inference_service_job_queue_depth{model_name="echo",model_version="1.0"} 2.0\n' in text
    assert 'inference_service_workers{model_name="echo",model_version="1.0",state="READY"} 1.0\n' in text
    assert 'inference_service_workers{model_name="echo",model_version="1.0",state="BUSY"} 0.0\n' in text
    assert 'inference_service_worker_restarts_total{model_name="echo",model_version="1.0"} 4.0\n' in text


def test_json_formatter_fields_and_traceback():
    try:
        raise ValueError("bad")
    except ValueError:
        record = logging.LogRecord("x.y", logging.ERROR, __file__, 1, "failed %s", ("now",), sys.exc_info())
    record.model = "echo"
    record.worker_id = 9000
    data = json.loads(JsonFormatter().format(record))
    assert data["level"] == "ERROR" and data["logger"] == "x.y" and data["message"] == "failed now"
    assert data["model"] == "echo" and data["worker_id"] == 9000 and data["time"].endswith("Z")
    assert "ValueError: bad" in data["exc_info"]


class _LlmSource:
    def __init__(self) -> None:
        self.pids = frozenset({11, 12})

    def stats(self):
        return 0, [VersionStats(model_name="llm", model_version="1.0", queue_depth=0,
                                   workers={"READY": 2}, restarts=0, worker_pids=self.pids)]


def test_serving_statistics_become_llm_metrics(caplog):
    """Worker-forwarded serving statistics: counters add up, gauges sum over the running
    workers (a gone worker's are dropped), and the model's requests feed the LLM histograms."""
    m = ServerMetrics(hostname="h")
    source = _LlmSource()
    m.attach(source)
    before = m.model("llm", "1.0")  # created before the model was known as an LLM
    m.handler_metrics("llm", "1.0", [
        ("serving:prompt_tokens", "counter", "", {"pid": "11"}, 12.0),
        ("serving:generation_tokens", "counter", "", {"pid": "11"}, 30.0),
        ("serving:generation_tokens", "counter", "", {"pid": "12"}, 4.0),
        ("serving:preempted_total", "counter", "", {"pid": "12"}, 1.0),
        ("serving:running", "gauge", "", {"pid": "11"}, 3.0),
        ("serving:running", "gauge", "", {"pid": "12"}, 2.0),
        ("serving:waiting", "gauge", "", {"pid": "12"}, 1.0),
        ("serving:kv_cache_used_tokens", "gauge", "", {"pid": "11"}, 300.0),
        ("serving:kv_cache_capacity_tokens", "gauge", "", {"pid": "11"}, 1000.0),
        ("serving:kv_cache_capacity_tokens", "gauge", "", {"pid": "12"}, 1000.0),
        ("serving:bogus", "gauge", "", {"pid": "12"}, 1.0),  # dropped, with a warning
        ("serving:prompt_tokens", "counter", "", {"pid": "12"}, -5.0),  # dropped
    ])
    assert any("'bogus'" in r.getMessage() for r in caplog.records)
    text = m.render().decode()
    labels = 'model_name="llm",model_version="1.0"'
    assert f"inference_service_llm_prompt_tokens_total{{{labels}}} 12.0\n" in text
    assert f"inference_service_llm_generation_tokens_total{{{labels}}} 34.0\n" in text
    assert f"inference_service_llm_num_preemptions_total{{{labels}}} 1.0\n" in text
    assert f"inference_service_llm_num_requests_running{{{labels}}} 5.0\n" in text
    assert f"inference_service_llm_num_requests_waiting{{{labels}}} 1.0\n" in text
    assert f"inference_service_llm_kv_cache_capacity_tokens{{{labels}}} 2000.0\n" in text
    assert f"inference_service_llm_kv_cache_usage_perc{{{labels}}} 0.15\n" in text
    source.pids = frozenset({11})  # worker 12 is gone: its gauges leave the sums, counters stay
    text = m.render().decode()
    assert f"inference_service_llm_num_requests_running{{{labels}}} 3.0\n" in text
    assert f"inference_service_llm_generation_tokens_total{{{labels}}} 34.0\n" in text
    # the request histograms: first message (TTFT), text gaps (ITL; the final message left out), e2e
    for stats in (before, m.model("llm", "2.0")):
        last = stats.message(time.monotonic() - 0.3, 0.0)
        last = stats.message(0.0, last - 0.05)
        stats.message(0.0, last, final=True)
        stats.finish(time.monotonic() - 1.0, 0.0, ok=True)
    text = m.render().decode()
    for version in ("1.0", "2.0"):
        labels = f'model_name="llm",model_version="{version}"'
        assert f"inference_service_llm_time_to_first_token_seconds_count{{{labels}}} 1.0\n" in text
        assert f"inference_service_llm_inter_token_latency_seconds_count{{{labels}}} 1.0\n" in text
        assert f"inference_service_llm_e2e_request_latency_seconds_count{{{labels}}} 1.0\n" in text
    # a model that never reported serving statistics has no LLM series
    other = m.model("echo", "1.0")
    other.message(time.monotonic(), 0.0)
    assert 'inference_service_llm_time_to_first_token_seconds_count{model_name="echo"' not in m.render().decode()


def test_routing_gauges_under_the_names_the_endpoint_picker_reads():
    """vllm:num_requests_waiting / _running / kv_cache_usage_perc / cache_config_info, one series per
    LLM model summed over its versions' running workers; waiting counts the job queue too."""
    from prometheus_client.parser import text_string_to_metric_families

    m = ServerMetrics(hostname="h")

    class Source:
        def stats(self):
            return 0, [VersionStats(model_name="llm", model_version=v, queue_depth=q, workers={"READY": 1},
                                       restarts=0, worker_pids=frozenset({p}))
                       for v, q, p in (("1.0", 3, 11), ("2.0", 0, 12))] + [
                VersionStats(model_name="echo", model_version="1.0", queue_depth=9, workers={"READY": 1},
                                restarts=0, worker_pids=frozenset({13}))]

    m.attach(Source())
    for version, pid, running, waiting, used in (("1.0", "11", 2, 1, 300), ("2.0", "12", 1, 0, 100)):
        m.handler_metrics("llm", version, [
            ("serving:running", "gauge", "", {"pid": pid}, running),
            ("serving:waiting", "gauge", "", {"pid": pid}, waiting),
            ("serving:kv_cache_used_tokens", "gauge", "", {"pid": pid}, used),
            ("serving:kv_cache_capacity_tokens", "gauge", "", {"pid": pid}, 1000),
        ])
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    samples = {name: [(s.labels, s.value) for s in families[name].samples]
               for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                            "vllm:cache_config_info")}
    assert all(families[name].type == "gauge" for name in samples)
    assert samples["vllm:num_requests_waiting"] == [({"model_name": "llm"}, 4.0)]  # 1 in an engine + 3 queued
    assert samples["vllm:num_requests_running"] == [({"model_name": "llm"}, 3.0)]
    assert samples["vllm:kv_cache_usage_perc"] == [({"model_name": "llm"}, 0.2)]
    assert samples["vllm:cache_config_info"] == [
        ({"model_name": "llm", "block_size": "16", "num_gpu_blocks": "125"}, 1.0)]
    # the names filter (?name[]=) knows them; echo reports no serving statistics: no routing series
    only = m.render({"vllm:num_requests_waiting"}).decode()
    assert 'vllm:num_requests_waiting{model_name="llm"} 4.0' in only and "running" not in only
