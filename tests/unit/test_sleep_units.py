"""``idleTimeoutSec`` in model-config.yaml (serving/sleep.py)."""

from __future__ import annotations

import pytest

from inference_service.errors import InvalidArgument
from inference_service.serving.model_config import ModelConfig


def test_idle_timeout_from_model_config_yaml():
    assert ModelConfig.resolve({}, {}).idle_timeout_s == 0.0  # off by default
    assert ModelConfig.resolve({"idleTimeoutSec": 2.5}, {}).idle_timeout_s == 2.5
    assert ModelConfig.resolve({"idleTimeoutSec": "30"}, {}).idle_timeout_s == 30.0
    for bad in (-1, 604_801, "soon"):
        with pytest.raises(InvalidArgument, match="idle_timeout_s"):
            ModelConfig.resolve({"idleTimeoutSec": bad}, {})
