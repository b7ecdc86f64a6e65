"""contracts/stats.py: one declaration of an engine statistic gives its METRIC frame update, its
Prometheus family on /metrics and its place in the worker's log metrics line."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from inference_service.contracts import wire
from inference_service.contracts.stats import STAT_TYPES, IterationStats, SchedulerStats, VersionStats, specs, stat
from inference_service.handler.metrics import Metrics
from inference_service.observability.metrics import ServerMetrics

LABELS = 'model_name="llm",model_version="1.0"'


@dataclass(slots=True)
class WithDraftTokens(SchedulerStats):
    """SchedulerStats with one more field, as a contributor would add it."""

    draft_tokens_total: int = stat("total", "spec_decode_num_draft_tokens", "LLM: draft tokens proposed.")
    draft_acceptance: int = stat("gauge", "spec_decode_acceptance", "LLM: accepted draft tokens in the last step.")


class _Source:
    def stats(self):
        return 0, [VersionStats(model_name="llm", model_version="1.0", queue_depth=0, workers={"READY": 1},
                                restarts=0, worker_pids=frozenset({4242}))]


def _through_the_wire(worker: Metrics) -> list:
    """The worker's queued updates as the server decodes them from a METRIC frame, keyed by pid 4242."""
    frame = wire.encode_metrics(worker.drain())
    updates = wire.decode_metrics(frame[wire.HEADER.size:])
    return [(name, kind, unit, {"pid": "4242"}, value) for name, kind, unit, _dims, value in updates]


def test_one_field_is_a_family_on_metrics_and_in_the_log_metrics(caplog):
    worker = Metrics("llm")
    worker.stats_log_interval_s = 0.0
    server = ServerMetrics(hostname="h", system_metrics=False, stat_types=(WithDraftTokens, IterationStats))
    server.attach(_Source())
    with caplog.at_level(logging.INFO, logger="inference_service.metrics"):
        worker.add_stats(WithDraftTokens(running=2, preempted_total=1, draft_tokens_total=7, draft_acceptance=3))
        worker.add_stats(WithDraftTokens(running=2, preempted_total=1, draft_tokens_total=10, draft_acceptance=4))
    server.handler_metrics("llm", "1.0", _through_the_wire(worker))
    text = server.render().decode()
    assert f"inference_service_llm_spec_decode_num_draft_tokens_total{{{LABELS}}} 10.0\n" in text  # increments
    assert f"inference_service_llm_spec_decode_acceptance{{{LABELS}}} 4.0\n" in text
    assert "# HELP inference_service_llm_spec_decode_num_draft_tokens_total LLM: draft tokens proposed." in text
    assert f"inference_service_llm_num_requests_running{{{LABELS}}} 2.0\n" in text
    assert f"inference_service_llm_num_preemptions_total{{{LABELS}}} 1.0\n" in text
    last = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine stats of llm:")][-1]
    assert "draft_tokens_total=10" in last and "draft_acceptance=4" in last and "running=2" in last
    # the families the server declares: every field of the default statistics, nothing else
    default = ServerMetrics(hostname="h", system_metrics=False)
    default.attach(_Source())
    families = {line.split()[2] for line in default.render().decode().splitlines()
                if line.startswith("# TYPE inference_service_llm_")}
    expected = {"inference_service_llm_" + s.family + ("_total" if s.counter else "")
                for s in specs(STAT_TYPES).values()}
    assert expected <= families and "inference_service_llm_spec_decode_acceptance" not in families


def test_worker_sends_increments_and_changed_gauges_only():
    worker = Metrics("llm")
    worker.forward()  # metrics_mode=prometheus: no log line
    worker.add_stats(SchedulerStats(running=1, preempted_total=2))
    worker.add_stats(SchedulerStats(running=1, preempted_total=2))  # nothing changed: nothing sent
    worker.add_stats(IterationStats(prompt_tokens=5, generation_tokens=1))
    worker.add_stats(IterationStats())  # zero increments: nothing sent
    worker.add_stats(SchedulerStats(running=0, preempted_total=3))
    sent = [(name, kind, value) for name, kind, _unit, _dims, value in worker.drain()]
    assert sent == [
        ("serving:running", "gauge", 1.0), ("serving:waiting", "gauge", 0.0),
        ("serving:preempted_total", "counter", 2.0), ("serving:kv_cache_used_tokens", "gauge", 0.0),
        ("serving:kv_cache_allocated_tokens", "gauge", 0.0), ("serving:kv_cache_capacity_tokens", "gauge", 0.0),
        ("serving:prompt_tokens", "counter", 5.0), ("serving:generation_tokens", "counter", 1.0),
        ("serving:running", "gauge", 0.0), ("serving:preempted_total", "counter", 1.0),
    ]
    with pytest.raises(ValueError, match="unknown serving statistic 'bogus'"):
        worker.add_serving_stat("bogus", 1)


def test_log_metrics_line_is_rate_limited(caplog):
    worker = Metrics("llm")
    worker.stats_log_interval_s = 3600.0
    with caplog.at_level(logging.INFO, logger="inference_service.metrics"):
        for tokens in range(1, 50):
            worker.add_stats(IterationStats(generation_tokens=tokens))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine stats of")]
    assert lines == ["engine stats of llm: generation_tokens=1"]  # the first, then none within the interval
