"""Unit tests of the observability pieces: settings, METRIC frames, the exposition, the JSON log format."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import grpc
import pytest

from inference_service.accesslog import JsonFormatter
from inference_service.cli import build_parser, settings_from_args
from inference_service.config import ConfigError
from inference_service.handler.metrics import Dimension, Metrics, MetricTypes
from inference_service.metrics import ServerMetrics
from inference_service.worker import protocol


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
    frame = protocol.encode_metrics(updates)
    assert protocol.HEADER.unpack_from(frame)[1] == protocol.METRIC
    assert protocol.decode_metrics(frame[protocol.HEADER.size:]) == updates
    assert protocol.decode_metrics(b'[["ok","gauge","u",{},1], ["bad"], 3]') == [("ok", "gauge", "u", {}, 1.0)]
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_metrics(b"{not json")


def _spec() -> protocol.WorkerSpec:
    return protocol.WorkerSpec("m", "1.0", "/x", "h.py", {}, {}, 1, 9000)


def test_exposition_of_frontend_and_handler_metrics(caplog):
    m = ServerMetrics(hostname="h")
    stats = m.model("echo", "")
    stats.requests += 2
    stats.latency_us += 1500.0
    assert m.model("echo", "") is stats and m.model("echo", "1.0") is not stats
    m.error("Predictions", grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND")
    dims = {"ModelName": "m", "Level": "Model"}
    frame = protocol.encode_metrics([
        ("Hits", "counter", "Count", dims, 2.0), ("Hits", "counter", "Count", dims, 3.0),
        ("Hits", "counter", "Count", dims, -1.0),                      # counters never decrease: dropped
        ("Hits", "gauge", "Count", dims, 9.0),                         # type changed: dropped
        ("Load", "gauge", "Percent", dims, 0.5), ("Load", "gauge", "Percent", dims, 0.25),
        ("Lat-ms", "histogram", "ms", dims, 0.02), ("Lat-ms", "histogram", "ms", dims, 20.0),
        ("ts_inference_requests_total", "counter", "Count", dims, 1.0),  # the server's name: dropped
    ])
    with caplog.at_level(logging.WARNING, logger="inference_service.metrics"):
        m.handler_metrics(_spec(), frame[protocol.HEADER.size:])
        m.handler_metrics(_spec(), b"garbage")  # never raises
    assert len(caplog.records) == 4
    text = m.render().decode()
    assert "# TYPE ts_inference_latency_microseconds counter\n" in text  # TorchServe's name, no _total
    assert 'ts_inference_requests_total{model_name="echo",model_version="default",hostname="h"} 2.0\n' in text
    assert 'ts_inference_latency_microseconds{model_name="echo",model_version="default",hostname="h"} 1500.0' in text
    assert 'ts_inference_requests_total{model_name="echo",model_version="1.0",hostname="h"} 0.0' in text
    assert ('inference_service_errors_total{code="NOT_FOUND",method="Predictions",reason="MODEL_NOT_FOUND"} 1.0'
            in text)
    assert 'Hits{ModelName="m",Level="Model",Hostname="h"} 5.0\n' in text
    assert 'Load{ModelName="m",Level="Model",Hostname="h"} 0.25\n' in text
    assert 'Lat_ms_bucket{ModelName="m",Level="Model",Hostname="h",le="0.025"} 1\n' in text
    assert 'Lat_ms_bucket{ModelName="m",Level="Model",Hostname="h",le="+Inf"} 2\n' in text
    assert 'Lat_ms_count{ModelName="m",Level="Model",Hostname="h"} 2\n' in text
    only = m.render({"Hits", "inference_service_errors"}).decode()
    assert "Hits{" in only and "inference_service_errors_total{" in only
    assert "ts_inference" not in only and "Load{" not in only


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
