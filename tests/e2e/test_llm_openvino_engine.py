"""The OpenVINO engine in-process, on a tiny random Llama converted to fp32 IR: preemption and
resumption, cancellation, its statistics, and the sampling options it maps to OpenVINO GenAI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def ir(tiny_llama: Path, tiny_ir: Path) -> tuple[Path, Any, Any]:
    """The tiny model's fp32 IR directory, its tokenizer, and the same model in torch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (tiny_ir, AutoTokenizer.from_pretrained(str(tiny_ir)),
            AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval())


@pytest.mark.slow  # a conversion by optimum-intel's exporter: 20 to 40 s on 2 cores
def test_a_fresh_conversion_carries_the_tokenizer_models_and_is_cached(tiny_llama: Path, tmp_path: Path) -> None:
    from inference_service.llm.openvino_ir import prepare_ir

    ir_dir, seconds = prepare_ir(tiny_llama, "fp32", tmp_path / "cache")
    assert seconds is not None and prepare_ir(tiny_llama, "fp32", ir_dir.parent.parent)[1] is None  # cached now
    # a fresh conversion carries the OpenVINO tokenizer models: structured outputs read its vocabulary
    assert (ir_dir / "openvino_tokenizer.xml").is_file() and (ir_dir / "openvino_detokenizer.xml").is_file()


def _engine(ir: tuple[Path, Any, Any], seqs: int = 4) -> Any:
    from inference_service.llm.openvino_engine import OpenVINOEngine

    ir_dir, tokenizer, _ = ir
    return OpenVINOEngine(ir_dir, tokenizer, {tokenizer.eos_token_id}, max_num_seqs=seqs, max_model_len=2048,
                          weight_format="fp32", threads=1)


def _ids(ir: tuple[Path, Any, Any], text: str) -> list[int]:
    return list(ir[1](text)["input_ids"])


def _run(engine: Any, active: list[str] | None = None, steps: int = 400) -> dict[str, Any]:
    """Step until the active requests (all when None) ended; their results by key."""
    done: dict[str, Any] = {}
    for _ in range(steps):
        for key, out in engine.step(active).items():
            if out.finished:
                done[key] = out.result
        if not any(engine.has(k) for k in (active if active is not None else engine.keys())):
            break
    return done


def _params(**kwargs: Any) -> Any:
    from inference_service.llm.params import GenerationParams

    return GenerationParams(**{"max_new_tokens": 24, "ignore_eos": True, **kwargs})


def test_a_preempted_request_resumes_with_the_tokens_it_would_have_produced(ir):
    engine = _engine(ir)
    engine.add("alone", _ids(ir, "Once upon a time"), _params())
    want = _run(engine)["alone"].token_ids
    engine.add("a", _ids(ir, "Once upon a time"), _params())
    engine.add("b", _ids(ir, "The weather today"), _params())
    for _ in range(5):
        engine.step()
    assert engine.preempt("a") and not engine.preempt("a")  # its cache is gone; twice is a no-op
    stats = engine.stats()
    assert stats.preempted_total == 1 and stats.running + stats.waiting == 2
    _run(engine, ["b"])  # "a" is paused meanwhile: no pipeline request, nothing generated
    assert engine.has("a") and not engine.has("b")
    got = _run(engine)["a"]
    assert got.token_ids == want and got.finish_reason == "length"
    assert engine.stats().running == 0 and len(engine) == 0


def test_a_preempted_seeded_sampled_request_gives_the_tokens_of_the_request_alone(ir):
    """A seeded sampled request is replayed from its prompt and seed after a preemption: the
    tokens the client has are regenerated, checked and skipped, the rest are those of the
    request unpreempted; the running gauge counts no preempted request."""
    engine = _engine(ir)
    params = _params(temperature=1.0, top_p=0.9, seed=1234, max_new_tokens=60)
    engine.add("alone", _ids(ir, "Once upon a time"), params)
    want = _run(engine)["alone"].token_ids
    engine.add("a", _ids(ir, "Once upon a time"), params)
    engine.add("b", _ids(ir, "The weather today"), params)
    for _ in range(6):
        engine.step()
    assert engine.preempt("a") and engine.preempt("b")
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (0, 2)  # both preempted, no step since
    for _ in range(3):
        engine.step(["b"])
    assert engine.preempt("b")  # preempted again part-way through its replay
    got = _run(engine)
    assert got["a"].token_ids == want and got["b"].token_ids != want
    engine.add("b2", _ids(ir, "The weather today"), params)
    assert _run(engine)["b2"].token_ids == got["b"].token_ids
    assert len(engine) == 0 and not engine.pipeline.has_non_finished_requests()


def test_cancel_ends_a_request_at_once_and_the_others_go_on(ir):
    engine = _engine(ir)
    engine.add("x", _ids(ir, "Hello"), _params())
    engine.add("y", _ids(ir, "Hello there"), _params())
    engine.step()
    result = engine.cancel("x")
    assert result is not None and result.finish_reason == "cancelled" and not engine.has("x")
    assert engine.cancel("x") is None
    assert set(_run(engine)) == {"y"}
    assert not engine.pipeline.has_non_finished_requests()


def test_seeded_sampling_repeats_and_top_k_1_is_greedy(ir):
    engine = _engine(ir)
    prompt = _ids(ir, "A story about a robot")
    engine.add("greedy", prompt, _params())
    engine.add("s1", prompt, _params(temperature=1.0, seed=7))
    engine.add("s2", prompt, _params(temperature=1.0, seed=7))
    engine.add("k1", prompt, _params(temperature=1.0, seed=3, top_k=1))
    done = _run(engine)
    assert done["s1"].token_ids == done["s2"].token_ids != done["greedy"].token_ids
    assert done["k1"].token_ids == done["greedy"].token_ids


def test_sampling_options_map_to_openvino_and_opposite_penalties_are_refused():
    from inference_service.llm.engine_protocol import refusal
    from inference_service.llm.engines import CAPABILITIES
    from inference_service.llm.openvino_engine import OpenVINOEngine
    from inference_service.llm.openvino_settings import generation_config

    config = generation_config(_params(temperature=0.5, top_p=0.9, top_k=5, repetition_penalty=1.3, seed=11),
                               4, {2})
    assert (config.do_sample, config.top_k, config.max_new_tokens, config.rng_seed) == (True, 5, 20, 15)
    assert abs(config.temperature - 0.5) < 1e-6 and abs(config.repetition_penalty - 1.3) < 1e-6
    assert config.stop_token_ids == {2} and config.ignore_eos is True
    assert generation_config(_params(), 0, {2}).do_sample is False
    every = tuple(CAPABILITIES.values())
    assert refusal(OpenVINOEngine.capabilities, _params(repetition_penalty=1.2, top_k=3), every) is None
    for name in ("presence_penalty", "frequency_penalty"):
        assert refusal(CAPABILITIES["torch"], _params(**{name: 0.5}), every) is None
        message = refusal(OpenVINOEngine.capabilities, _params(**{name: 0.5}), every)
        assert message is not None and f"'{name}'" in message and "engine: torch" in message


def test_stop_strings_and_max_new_tokens_are_ours(ir):
    engine = _engine(ir)
    prompt = _ids(ir, "Count with me")
    engine.add("full", prompt, _params(max_new_tokens=12))
    full = _run(engine)["full"]
    text = ir[1].decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2:][:3]
    engine.add("stopped", prompt, _params(max_new_tokens=12, stop=(stop,)))
    stopped = _run(engine)["stopped"]
    assert stopped.finish_reason == "stop" and stopped.stop_string == stop
    assert full.finish_reason == "length" and full.completion_tokens == 12


def test_a_stop_token_id_ends_generation_on_both_engines(ir):
    """Each engine's third greedy token as a stop token id: generation stops there, with the
    token counted and not emitted, even with ignore_eos."""
    from inference_service.llm.engine import GenerationEngine

    tokenizer = ir[1]
    prompt = _ids(ir, "Tell me a story")
    engines = {"openvino": _engine(ir), "torch": GenerationEngine(ir[2], tokenizer, max_num_seqs=4)}
    for name, engine in engines.items():
        engine.add("free", prompt, _params(max_new_tokens=8))
        free = _run(engine)["free"].token_ids
        engine.add("stopped", prompt, _params(max_new_tokens=8, stop_token_ids=(free[2],)))
        stopped = _run(engine)["stopped"]
        assert stopped.finish_reason == "stop" and stopped.token_ids == free[:3], name
