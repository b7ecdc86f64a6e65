"""The model-server protocol's gauges, under the names the Gateway API Inference Extension's
endpoint picker (and llm-d's router) read by default: vLLM's ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and ``vllm:cache_config_info``, one
series per LLM model (label ``model_name``, vLLM's served model name), summed over its versions.

Derived from the engines' :class:`~inference_service.contracts.stats.SchedulerStats`: waiting is
what the engines hold waiting for their prefill plus what the job queue holds (a request either
way accepted and not yet running, the protocol's "requests in the queue"); KV cache use is a
fraction, 0 to 1, as vLLM's. See docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

#: Tokens per KV cache block reported in ``vllm:cache_config_info`` (vLLM's default block size).
#: The engines keep their cache per token position, so the block count is the capacity in tokens
#: divided by it; the endpoint picker hashes prompt prefixes in blocks of this many tokens.
BLOCK_SIZE = 16
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
NAMES = (WAITING, RUNNING, KV_USAGE, CACHE_INFO)


def routing_families(versions: Iterable[tuple[str, dict[str, float], int]]) -> Iterator[Metric]:
    """The four families from ``(model name, a version's summed engine gauges, its job queue depth)``."""
    per_model: dict[str, dict[str, float]] = {}
    for name, totals, queue_depth in versions:
        model = per_model.setdefault(name, {"waiting": 0.0, "running": 0.0, "used": 0.0, "capacity": 0.0})
        model["waiting"] += totals.get("waiting", 0.0) + queue_depth
        model["running"] += totals.get("running", 0.0)
        model["used"] += totals.get("kv_cache_used_tokens", 0.0)
        model["capacity"] += totals.get("kv_cache_capacity_tokens", 0.0)
    labels = ["model_name"]
    waiting = GaugeMetricFamily(WAITING, "Requests waiting to be processed (the job queue and the engines' "
                                         "waiting requests).", labels=labels)
    running = GaugeMetricFamily(RUNNING, "Requests running in the engines.", labels=labels)
    usage = GaugeMetricFamily(KV_USAGE, "KV cache usage: 1 means 100 percent.", labels=labels)
    info = GaugeMetricFamily(CACHE_INFO, "KV cache configuration (the labels; the value is 1).",
                             labels=[*labels, "block_size", "num_gpu_blocks"])
    for name, model in sorted(per_model.items()):
        waiting.add_metric([name], model["waiting"])
        running.add_metric([name], model["running"])
        usage.add_metric([name], model["used"] / model["capacity"] if model["capacity"] else 0.0)
        info.add_metric([name, str(BLOCK_SIZE), str(int(model["capacity"]) // BLOCK_SIZE)], 1.0)
    yield from (waiting, running, usage, info)
