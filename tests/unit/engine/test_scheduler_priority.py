"""Priorities in the scheduler (scripted outputs, no model): batch lines (priority 1) run in the slots interactive
requests leave, give a slot up to an interactive request that finds none (recompute preemption) and go on where
they were, with the same tokens."""

from __future__ import annotations

from engine.prefix_cache import MIN_RECOMPUTED
from engine.scheduler import Request, Scheduler
from engine.types import EngineOverloadedError, SamplingParams

EOS = 2


def make(rid: str, priority: int = 0, prompt_len: int = 4, max_tokens: int = 6) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=frozenset({EOS}), max_model_len=64, priority=priority)


def step(sched: Scheduler, token_of=lambda r: 100 + len(r.output_ids)):
    """One scripted step; a request's n-th output token is 100 + n (so a resumed one must go on counting)."""
    out = sched.schedule()
    need = list(out.decode)
    for chunk in out.prefills:
        if chunk.is_last:
            need.append(chunk.request)
    return out, sched.update_from_output(out, {r: token_of(r) for r in need})


def test_interactive_requests_are_admitted_before_batch_lines_that_wait():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=32)
    for i in range(3):
        sched.add(make(f"b{i}", priority=1))
    sched.add(make("i0"))
    sched.schedule()
    assert {sched.slot_owner(s).request_id for s in range(2)} == {"i0", "b0"}
    assert [r.request_id for r in sched.waiting] == ["b1", "b2"]


def test_batch_lines_do_not_count_against_the_waiting_bound():
    sched = Scheduler(num_slots=1, max_waiting=1, token_budget=8)
    for i in range(5):
        sched.add(make(f"b{i}", priority=1))
    sched.add(make("i0"))
    try:
        sched.add(make("i1"))
    except EngineOverloadedError:
        pass
    else:
        raise AssertionError("a second interactive request should not fit the waiting bound of 1")


def test_an_interactive_request_preempts_the_last_batch_line_which_resumes_with_the_same_tokens():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=32, prefix_caching=True, can_copy=True)
    sched.add(make("b0", priority=1))
    sched.add(make("b1", priority=1))
    for _ in range(4):
        step(sched)  # b0's prompt, then b1's (one batch line's prompt per step), then decode steps
    b1 = sched.running[("b1", 0)]
    assert b1.output_ids == [100, 101, 102]
    slot = b1.slot
    sched.add(make("i0"))
    out, _ = step(sched)
    assert out.released == ((slot, 6),)  # its row held prompt 4 + 2 tokens (the third was not run yet)
    assert sched.slot_owner(slot).request_id == "i0"  # the interactive request has its slot now
    assert [r.request_id for r in sched.waiting] == ["b1"] and b1.num_preemptions == 1
    assert b1.prompt_ids == [10, 11, 12, 13, 100, 101, 102] and b1.output_ids == []
    finished = {}
    for _ in range(20):
        _, done = step(sched, token_of=lambda r: 100 + len(r.prompt_ids) - 4 + len(r.output_ids)
                       if r.request_id == "b1" else 100 + len(r.output_ids))
        finished.update({f.request.request_id: f.request for f in done})
        if not sched.has_work:
            break
    # b1 went on from its fourth token and stopped at max_tokens 6 in all: prompt 4 + 6 tokens
    assert finished["b1"].prompt_ids + finished["b1"].output_ids == [10, 11, 12, 13, 100, 101, 102, 103, 104, 105]
    assert set(finished) == {"b0", "b1", "i0"} and sched.num_free_slots == 2


def test_interactive_requests_never_preempt_each_other_nor_a_request_with_choices():
    sched = Scheduler(num_slots=1, max_waiting=4, token_budget=32)
    sched.add(make("i0"))
    step(sched)
    sched.add(make("i1"))
    out, _ = step(sched)
    assert not out.released and sched.slot_owner(0).request_id == "i0"


def test_interactive_prompt_chunks_go_before_batch_lines_prompt_chunks():
    sched = Scheduler(num_slots=3, max_waiting=4, token_budget=40)
    sched.add(make("b0", priority=1, prompt_len=30))
    sched.add(make("i0", prompt_len=30))
    out = sched.schedule()
    assert out.prefill.request.request_id == "i0" and out.prefill.num_tokens == 30


def test_batch_lines_sit_out_the_steps_of_an_interactive_prompt():
    sched = Scheduler(num_slots=3, max_waiting=4, token_budget=64)
    sched.add(make("b0", priority=1))
    sched.add(make("b1", priority=1, prompt_len=40))
    step(sched)  # b0's prompt whole, b1's first chunk... both in one step
    sched.add(make("i0", prompt_len=30))
    out, _ = step(sched)
    assert [c.request.request_id for c in out.prefills] == ["i0"] and out.decode == ()
    out, _ = step(sched)  # i0 decodes now: the batch lines go on beside it
    assert {r.request_id for r in out.decode} >= {"i0", "b0"}


def test_one_batch_line_prompt_per_step():
    sched = Scheduler(num_slots=4, max_waiting=8, token_budget=64)
    for i in range(3):
        sched.add(make(f"b{i}", priority=1))
    firsts = [[c.request.request_id for c in step(sched)[0].prefills] for _ in range(3)]
    assert firsts == [["b0"], ["b1"], ["b2"]]


def run_out(sched: Scheduler) -> None:
    for _ in range(40):
        step(sched)
        if not any(r.priority == 0 for r in sched.running.values()) and not sched.waiting:
            return


def test_a_row_an_interactive_request_left_is_kept_from_batch_lines_and_its_prompt_reused():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=32, prefix_caching=True, can_copy=True)
    sched.add(make("i0", prompt_len=12))
    run_out(sched)  # i0 finished: its row keeps its prompt and output
    held = next(s for s in range(2) if sched.cache.cached(s))
    sched.add(make("b0", priority=1))
    sched.add(make("b1", priority=1))
    step(sched)
    assert sched.slot_owner(held) is None and [r.request_id for r in sched.waiting] == ["b1"]  # one row for the batch
    sched.add(make("i1", prompt_len=12))  # the same prompt again
    step(sched)
    i1 = sched.slot_owner(held)
    assert i1 is not None and i1.request_id == "i1" and i1.num_cached_tokens == 12 - MIN_RECOMPUTED
    assert sched.num_preemptions_total == 0  # it found a free row: no batch line was computed again


def test_without_a_hold_batch_lines_take_every_row():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=32, prefix_caching=True, can_copy=True)
    sched.holds.hold_s = 0.0
    sched.add(make("i0", prompt_len=12))
    run_out(sched)
    sched.add(make("b0", priority=1))
    sched.add(make("b1", priority=1))
    step(sched)
    assert not sched.waiting and sched.num_free_slots == 0


def test_only_the_last_interactive_row_is_held_so_a_batch_never_waits_on_an_idle_engine():
    sched = Scheduler(num_slots=3, max_waiting=4, token_budget=32, prefix_caching=True, can_copy=True)
    for i in range(3):
        sched.add(make(f"i{i}", prompt_len=12))
    run_out(sched)  # three interactive requests left three rows
    for i in range(3):
        sched.add(make(f"b{i}", priority=1))
    out, _ = step(sched)
    assert len(sched.running) == 2 and [r.request_id for r in sched.waiting] == ["b2"] and out.prefills


def test_a_single_row_is_never_held():
    sched = Scheduler(num_slots=1, max_waiting=4, token_budget=32, prefix_caching=True, can_copy=True)
    sched.add(make("i0", prompt_len=12))
    run_out(sched)
    sched.add(make("b0", priority=1))
    step(sched)
    assert sched.slot_owner(0).request_id == "b0"
