"""The continuous-batching scheduler's rules, without a model: token budget, chunk order,
pause, preemption and recompute."""

from __future__ import annotations

import pytest

from inference_service.llm.scheduler import (
    PREEMPTED,
    PREFILLING,
    RUNNING,
    WAITING,
    PrefillChunk,
    Scheduler,
    SchedulerOutput,
)


def run(s: Scheduler, active: list[str] | None = None, finished: tuple[str, ...] = ()) -> SchedulerOutput:
    out = s.schedule(active)
    s.update(out, finished)
    return out


def test_without_a_budget_whole_prompts_prefill_in_one_step() -> None:
    s = Scheduler()
    s.add("a", 100)
    s.add("b", 7)
    out = run(s)
    assert out.decode == [] and out.prefill == [PrefillChunk("a", 0, 100, True), PrefillChunk("b", 0, 7, True)]
    assert out.num_batched_tokens == 107
    assert s.status("a") == RUNNING and s.num_computed("a") == 100
    out = run(s)
    assert out.decode == ["a", "b"] and out.prefill == [] and out.num_batched_tokens == 2


def test_a_long_prompt_is_spread_over_steps_and_decode_rows_come_first() -> None:
    s = Scheduler(max_num_batched_tokens=10)
    s.add("r1", 3)
    s.add("r2", 3)
    run(s)  # 6 tokens: both prompts in one step
    s.add("long", 25)
    chunks = []
    for _ in range(4):
        out = run(s)
        assert out.decode == ["r1", "r2"]  # every running request decodes every step
        assert out.num_batched_tokens <= 10
        chunks += out.prefill
    assert chunks == [PrefillChunk("long", 0, 8, False), PrefillChunk("long", 8, 16, False),
                      PrefillChunk("long", 16, 24, False), PrefillChunk("long", 24, 25, True)]
    assert s.status("long") == RUNNING
    assert run(s).decode == ["r1", "r2", "long"]


def test_a_partial_prefill_goes_before_newer_requests_and_max_prefill_seqs_bounds() -> None:
    s = Scheduler(max_num_batched_tokens=6, max_prefill_seqs=2)
    s.add("a", 10)
    s.add("b", 2)
    s.add("c", 2)
    out = run(s)
    assert out.prefill == [PrefillChunk("a", 0, 6, False)]
    assert s.status("a") == PREFILLING
    out = run(s)
    assert out.prefill == [PrefillChunk("a", 6, 10, True), PrefillChunk("b", 0, 2, True)]  # c: two already
    out = run(s)
    assert out.decode == ["a", "b"] and out.prefill == [PrefillChunk("c", 0, 2, True)]


def test_requests_left_out_are_paused_and_new_ones_wait() -> None:
    s = Scheduler()
    s.add("a", 4)
    s.add("b", 4)
    run(s, ["a"])
    assert s.status("b") == WAITING
    out = run(s, ["b"])
    assert out.decode == [] and out.paused == ["a"] and out.prefill == [PrefillChunk("b", 0, 4, True)]
    out = run(s, [])
    assert out.empty and sorted(out.paused) == ["a", "b"]


def test_preempted_request_recomputes_prompt_and_generated_tokens_first() -> None:
    s = Scheduler(max_num_batched_tokens=8)
    s.add("a", 5)
    run(s)  # prefill: 5 tokens computed, 1 sampled
    run(s)
    run(s)  # two decode steps: 3 tokens generated, 7 computed
    assert s.num_computed("a") == 7
    s.add("new", 3)
    assert s.preempt("a") and not s.preempt("a") and not s.preempt("new") and not s.preempt("nobody")
    assert s.status("a") == PREEMPTED and s.preempted_total == 1
    out = run(s, ["new"])  # "a" is not active: its cache goes, nothing recomputed
    assert out.preempted == ["a"] and out.prefill == [PrefillChunk("new", 0, 3, True)]
    s.add("newer", 4)
    out = run(s)  # "a" ahead of "newer"; 8 tokens = prompt 5 + generated 3
    assert out.preempted == [] and out.decode == ["new"]
    assert out.prefill == [PrefillChunk("a", 0, 7, False)]  # budget 8 - 1 decode row
    out = run(s)
    assert out.decode == ["new"]
    assert out.prefill == [PrefillChunk("a", 7, 8, True), PrefillChunk("newer", 0, 4, True)]
    assert s.status("a") == RUNNING and s.num_computed("a") == 8
    assert run(s).decode == ["new", "a", "newer"]


def test_a_request_preempted_mid_prefill_starts_over() -> None:
    s = Scheduler(max_num_batched_tokens=4)
    s.add("a", 10)
    run(s)
    assert s.preempt("a")
    out = run(s)
    assert out.preempted == ["a"] and out.prefill == [PrefillChunk("a", 0, 4, False)]


def test_finished_requests_leave() -> None:
    s = Scheduler()
    s.add("a", 2)
    s.add("b", 2)
    run(s, finished=("a",))  # "a" ended at its first token
    assert "a" not in s and s.keys() == ["b"] and len(s) == 1
    assert run(s).decode == ["b"]
    assert s.remove("b") and not s.remove("b") and len(s) == 0


def test_a_budget_smaller_than_the_decode_rows_defers_prefill() -> None:
    s = Scheduler(max_num_batched_tokens=2)
    for key in ("a", "b"):
        s.add(key, 1)
    run(s)
    s.add("c", 1)
    out = run(s)
    assert out.decode == ["a", "b"] and out.prefill == []
    s.remove("a")
    assert run(s).prefill == [PrefillChunk("c", 0, 1, True)]


def test_bad_settings_and_requests() -> None:
    with pytest.raises(ValueError):
        Scheduler(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        Scheduler(max_prefill_seqs=0)
    s = Scheduler()
    s.add("a", 1)
    with pytest.raises(ValueError):
        s.add("a", 1)
    with pytest.raises(ValueError):
        s.add("b", 0)
