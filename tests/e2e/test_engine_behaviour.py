"""One behaviour suite for every engine behind :class:`~inference_service.llm.engine_protocol.Engine`:
the torch engine and the OpenVINO engine, in-process, on the tiny random Llama (fp32 weights, fp32 IR),
each driven only through the declared interface."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inference_service.contracts.stats import SchedulerStats
from inference_service.llm.engine_protocol import REQUEST_FAULT, Engine, StepOutput, add_request
from inference_service.llm.params import GenerationParams

FAULT_SEED = 4242


@pytest.fixture(scope="module")
def tiny(tiny_llama: Path, tiny_ir: Path) -> dict[str, Any]:
    """The tiny model in torch and as fp32 IR, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, ir_dir = tiny_llama, tiny_ir
    return {"model": AutoModelForCausalLM.from_pretrained(str(model_dir)).eval(),
            "tokenizer": AutoTokenizer.from_pretrained(str(model_dir)), "ir_dir": ir_dir}


@pytest.fixture(params=["openvino", "torch"])
def make_engine(request: pytest.FixtureRequest, tiny: dict[str, Any]):
    """A factory of fresh engines of one kind (``seqs``: max_num_seqs)."""
    def make(seqs: int = 4) -> Engine:
        tokenizer = tiny["tokenizer"]
        if request.param == "torch":
            from inference_service.llm.engine import GenerationEngine

            return GenerationEngine(tiny["model"], tokenizer, max_num_seqs=seqs, max_num_batched_tokens=64)
        from inference_service.llm.openvino_engine import OpenVINOEngine

        return OpenVINOEngine(Path(tiny["ir_dir"]), tokenizer, {tokenizer.eos_token_id}, max_num_seqs=seqs,
                              max_model_len=2048, weight_format="fp32", threads=1)
    make.kind = request.param  # type: ignore[attr-defined]
    make.tokenizer = tiny["tokenizer"]  # type: ignore[attr-defined]
    return make


def _ids(make: Any, text: str) -> list[int]:
    return list(make.tokenizer(text)["input_ids"])


def _params(**kwargs: Any) -> GenerationParams:
    return GenerationParams(**{"max_new_tokens": 16, "ignore_eos": True, **kwargs})


def _run(engine: Engine, active: list[str] | None = None, steps: int = 500) -> dict[str, list[StepOutput]]:
    """Step until the active requests (all when None) left the engine; every output by key."""
    seen: dict[str, list[StepOutput]] = {}
    for _ in range(steps):
        for key, out in engine.step(active).items():
            seen.setdefault(key, []).append(out)
        if not any(engine.has(k) for k in (active if active is not None else engine.keys())):
            break
    return seen


def _text(outputs: list[StepOutput]) -> str:
    last = outputs[-1]
    return "".join(o.piece for o in outputs) + (last.result.remaining_text if last.result else "")


def test_greedy_text_is_the_same_alone_and_in_a_batch(make_engine):
    prompts = {k: _ids(make_engine, t) for k, t in (("a", "The sky is"), ("b", "Once upon a time"), ("c", "1 2 3"))}
    alone = {}
    for key, ids in prompts.items():
        engine = make_engine()
        engine.add(key, ids, _params())
        alone[key] = _text(_run(engine)[key])
    engine = make_engine()
    for key, ids in prompts.items():
        engine.add(key, ids, _params())
    together = {key: _text(outputs) for key, outputs in _run(engine).items()}
    assert together == alone
    assert len(engine) == 0


def test_max_new_tokens_and_stop_strings_end_a_request(make_engine):
    engine = make_engine()
    engine.add("long", _ids(make_engine, "Count with me"), _params(max_new_tokens=12))
    full = _run(engine)["long"][-1].result
    assert full is not None and full.finish_reason == "length" and full.completion_tokens == 12
    text = _text(_run(_added(make_engine(), "again", _ids(make_engine, "Count with me"),
                             _params(max_new_tokens=12)))["again"])
    stop = text[len(text) // 2:][:3]
    engine.add("stopped", _ids(make_engine, "Count with me"), _params(max_new_tokens=12, stop=(stop,)))
    outputs = _run(engine)["stopped"]
    assert outputs[-1].result is not None and outputs[-1].result.finish_reason == "stop"
    assert stop not in _text(outputs) and text.startswith(_text(outputs))


def _added(engine: Engine, key: str, ids: list[int], params: GenerationParams) -> Engine:
    engine.add(key, ids, params)
    return engine


def test_cancel_ends_one_request_and_the_others_go_on(make_engine):
    engine = make_engine()
    for key in ("x", "y"):
        engine.add(key, _ids(make_engine, f"Tell me about {key}"), _params(max_new_tokens=20))
    for _ in range(3):
        engine.step()
    result = engine.cancel("x")
    assert result is not None and result.finish_reason == "cancelled"
    assert engine.cancel("x") is None and not engine.has("x") and engine.has("y")
    rest = _run(engine)
    assert rest["y"][-1].result is not None and rest["y"][-1].result.completion_tokens == 20


def test_a_preempted_request_resumes_with_the_tokens_it_would_have_produced(make_engine):
    ids = _ids(make_engine, "The capital of France")
    reference = _text(_run(_added(make_engine(), "r", ids, _params(max_new_tokens=24)))["r"])
    engine = _added(make_engine(), "p", ids, _params(max_new_tokens=24))
    outputs: list[StepOutput] = []
    for _ in range(6):
        step = engine.step()
        outputs += [step["p"]] if "p" in step else []
    assert engine.preempt("p") and not engine.preempt("p")
    assert engine.stats().preempted_total == 1
    for key_outputs in _run(engine).values():
        outputs += key_outputs
    assert _text(outputs) == reference


def test_stats_count_running_and_waiting_within_capacity(make_engine):
    engine = make_engine(seqs=2)
    assert engine.stats() == SchedulerStats(running=0, waiting=0, preempted_total=0, kv_cache_used_tokens=0,
                                            kv_cache_allocated_tokens=0,
                                            kv_cache_capacity_tokens=engine.stats().kv_cache_capacity_tokens)
    for key in ("a", "b"):
        engine.add(key, _ids(make_engine, "Hello there"), _params(max_new_tokens=30))
    engine.step()
    engine.step()
    stats = engine.stats()
    assert stats.running + stats.waiting == 2 and stats.running >= 1
    assert 0 < stats.kv_cache_used_tokens <= stats.kv_cache_capacity_tokens
    engine.close()
    assert len(engine) == 0 and engine.keys() == []


def test_add_refuses_a_duplicate_key_and_an_empty_prompt(make_engine):
    engine = make_engine()
    engine.add("k", _ids(make_engine, "Hi"), _params())
    with pytest.raises(ValueError):
        engine.add("k", _ids(make_engine, "Hi"), _params())
    with pytest.raises(ValueError):
        engine.add("empty", [], _params())
    assert engine.keys() == ["k"]


def test_a_request_the_engine_fails_on_ends_alone(make_engine, monkeypatch: pytest.MonkeyPatch):
    """The fault a tiny temperature caused before requests were checked, planted in each engine."""
    if make_engine.kind == "openvino":
        from inference_service.llm import openvino_engine

        real = openvino_engine.generation_config

        def planted_config(params: GenerationParams, generated: int, eos: Any) -> Any:
            config = real(params, generated, eos)
            if params.seed == FAULT_SEED:
                config.temperature = 1e-46  # float32 0: OpenVINO GenAI refuses it
            return config

        monkeypatch.setattr(openvino_engine, "generation_config", planted_config)
    else:
        from inference_service.llm import runner

        def planted_penalize(*args: Any) -> Any:
            raise RuntimeError("planted sampler fault")

        monkeypatch.setattr(runner, "penalize", planted_penalize)
    engine = make_engine()
    for key in ("a", "b"):
        assert add_request(engine, key, _ids(make_engine, "Go on"), _params(max_new_tokens=10)) is None
    fault = add_request(engine, "bad", _ids(make_engine, "Break"),
                        _params(temperature=1.0, top_k=5, seed=FAULT_SEED))
    outputs = _run(engine)
    failed = fault if fault is not None else outputs["bad"][-1]
    assert failed.finished and failed.error == REQUEST_FAULT and failed.result is None
    assert not engine.has("bad")
    for key in ("a", "b"):
        assert outputs[key][-1].result is not None and outputs[key][-1].result.completion_tokens == 10


def test_the_openvino_kv_gauges_are_the_pipelines_own_cache(tiny: dict[str, Any], caplog: pytest.LogCaptureFixture):
    """Capacity: the paged cache the pipeline holds (by default batchSize x context, in blocks of 32); used:
    its blocks in use; a cache_size below batchSize x context is warned of at load."""
    from inference_service.llm.engine_protocol import refusal
    from inference_service.llm.engines import CAPABILITIES
    from inference_service.llm.openvino_engine import OpenVINOEngine

    tokenizer = tiny["tokenizer"]
    engine = OpenVINOEngine(Path(tiny["ir_dir"]), tokenizer, {tokenizer.eos_token_id}, max_num_seqs=3,
                            max_model_len=2000, weight_format="fp32", threads=1)
    assert engine.stats().kv_cache_capacity_tokens == 3 * 2016  # 63 blocks of 32 per request
    ids = list(tokenizer("word " * 100)["input_ids"])
    engine.add("a", ids, _params(max_new_tokens=40))
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    assert stats.kv_cache_used_tokens % 32 == 0 and len(ids) <= stats.kv_cache_used_tokens <= len(ids) + 3 + 32
    every = tuple(CAPABILITIES.values())
    salted = _params(cache_salt="tenant-1")
    assert "'cache_salt'" in (refusal(engine.capabilities, salted, every) or "")
    assert refusal(CAPABILITIES["torch"], salted, every) is None
    with caplog.at_level("WARNING"):
        small = OpenVINOEngine(Path(tiny["ir_dir"]), tokenizer, {tokenizer.eos_token_id}, max_num_seqs=3,
                               max_model_len=2000, weight_format="fp32", threads=1, kv_cache_gb=0.0001,
                               enable_prefix_caching=False)
    assert "OpenVINO preempts requests on its own" in caplog.text
    assert small.stats().kv_cache_capacity_tokens < 3 * 2000
    assert refusal(small.capabilities, salted, every) is None  # nothing shared without prefix caching


def _model_logprobs(tiny: dict[str, Any], ids: list[int], generated: list[int]) -> list[Any]:
    """The tiny model's own log-softmax rows at the positions that sampled ``generated``."""
    import torch

    with torch.inference_mode():
        logits = tiny["model"](torch.tensor([ids + generated])).logits[0].float()
    return list(torch.log_softmax(logits, dim=-1)[len(ids) - 1:len(ids) - 1 + len(generated)])


def test_logprobs_are_the_models_own_for_each_sampled_token(make_engine, tiny: dict[str, Any]):
    """Greedy and seeded sampling: one entry per token, the model's log probability of it (fp32)."""
    ids = _ids(make_engine, "The capital of France is")
    for params in (_params(logprobs=True), _params(logprobs=True, temperature=0.8, seed=7)):
        outputs = _run(_added(make_engine(), "r", ids, params))["r"]
        entries = [entry for out in outputs for entry in out.logprobs]
        tokens = outputs[-1].result.token_ids
        assert [e.token_id for e in entries] == tokens and len(tokens) == 16
        rows = _model_logprobs(tiny, ids, tokens)
        for entry, row in zip(entries, rows, strict=True):
            assert abs(entry.logprob - float(row[entry.token_id])) < 2e-3, (entry, float(row[entry.token_id]))
    plain = _run(_added(make_engine(), "p", ids, _params()))["p"]
    assert all(out.logprobs == [] for out in plain)


def test_top_logprobs_rank_the_models_alternatives(make_engine, tiny: dict[str, Any]):
    """The torch engine: the greedy token is the top one; OpenVINO GenAI has no alternatives (refused)."""
    from inference_service.llm.engine_protocol import refusal

    params = _params(logprobs=True, top_logprobs=5)
    engine = make_engine()
    if make_engine.kind == "openvino":
        assert "'top_logprobs' is not supported by the openvino engine" in (refusal(engine.capabilities, params)
                                                                           or "")
        return
    ids = _ids(make_engine, "Once upon a time")
    entries = [e for out in _run(_added(engine, "r", ids, params))["r"] for e in out.logprobs]
    assert len(entries) == 16
    for entry, row in zip(entries, _model_logprobs(tiny, ids, [e.token_id for e in entries]), strict=True):
        assert len(entry.top) == 5 and entry.top[0] == (entry.token_id, entry.logprob)
        assert [i for i, _ in entry.top] == row.topk(5).indices.tolist()
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:], strict=False))


def test_the_prefix_cache_counts_its_queries_and_hits(make_engine):
    """OpenVINO: a prompt sharing 96 leading tokens with an earlier one finds them; torch has no prefix cache."""
    shared = _ids(make_engine, "word " * 120)[:96]
    first, second = shared + _ids(make_engine, "one"), shared + _ids(make_engine, "two more")
    engine = _added(make_engine(), "a", first, _params(max_new_tokens=4))
    _run(engine)
    engine.add("b", second, _params(max_new_tokens=4))
    _run(engine)
    stats = engine.stats()
    assert stats.prefix_cache_queries_total == len(first) + len(second)
    assert stats.prefix_cache_hits_total == (96 if make_engine.kind == "openvino" else 0)
