"""The torch engine's logit rules: top-k, and the repetition, presence and frequency penalties."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from inference_service.llm.params import GenerationParams  # noqa: E402
from inference_service.llm.sampling import (  # noqa: E402
    make_generator,
    needs_logit_processing,
    penalize,
    sample_next_token,
)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 1.0, 3.0])
    out = penalize(logits, GenerationParams(repetition_penalty=2.0), prompt_ids=[0], generated_ids=[1])
    assert out.tolist() == [1.0, -4.0, 1.0, 3.0]
    assert logits.tolist() == [2.0, -2.0, 1.0, 3.0]  # a new tensor


def test_presence_and_frequency_penalties_lower_generated_tokens_only():
    logits = torch.tensor([1.0, -1.0, 0.5, 0.0])
    params = GenerationParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalize(logits, params, prompt_ids=[3], generated_ids=[1, 1, 2])
    assert out.tolist() == [1.0, -1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, 0.0]  # OpenAI's rule: always lower


def test_top_k_1_samples_the_argmax_and_plain_params_need_no_processing():
    logits = torch.tensor([0.1, 5.0, 0.2, 4.9])
    for seed in range(5):
        assert sample_next_token(logits, 1.0, 1.0, make_generator(seed), top_k=1) == 1
    assert not needs_logit_processing(GenerationParams(temperature=0.7, top_p=0.9))
    assert needs_logit_processing(GenerationParams(top_k=3))
    assert needs_logit_processing(GenerationParams(frequency_penalty=0.1))
