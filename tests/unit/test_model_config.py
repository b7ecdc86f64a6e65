"""How model-config keys choose a worker's mode and how many requests it runs at once."""

from inference_service.serving.model_config import ModelConfig


def _config(yaml: dict) -> ModelConfig:
    return ModelConfig.resolve(yaml, {})


def test_default_is_one_batch_at_a_time():
    config = _config({"batchSize": 4})
    assert (config.worker_mode, config.max_running) == ("batch", 1)


def test_continuous_batching_runs_batch_size_requests():
    config = _config({"continuousBatching": True, "batchSize": 8})
    assert (config.worker_mode, config.max_running) == ("continuous", 8)


def test_sequence_continuous_batching_runs_twice_batch_size_as_torchserve():
    config = _config({"continuousBatching": "true", "sequenceBatching": True, "batchSize": 1})
    assert (config.worker_mode, config.max_running) == ("continuous", 2)


def test_async_communication_is_bounded_by_the_job_queue():
    config = _config({"asyncCommunication": True, "jobQueueSize": 50, "continuousBatching": True})
    assert (config.worker_mode, config.max_running) == ("async", 50)
