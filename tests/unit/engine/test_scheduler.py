"""Scheduler with scripted outputs (no model): admission, budget, chunked prefill, stops, aborts."""

from __future__ import annotations

import random

import pytest

from engine.scheduler import Request, Scheduler
from engine.types import EngineOverloadedError, FinishReason, SamplingParams

EOS = 2


def make_request(rid, prompt_len=4, max_tokens=8, max_model_len=64, **params):
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset({EOS}), max_model_len=max_model_len)


def step(sched, token=5, tokens=None):
    """One scripted step: every request that needs a token gets ``token`` (or tokens[rid])."""
    out = sched.schedule()
    need = list(out.decode)
    for chunk in out.prefills:
        if chunk.is_last:
            need += [chunk.request, *chunk.request.forks]
    sampled = {r: (tokens or {}).get(r.request_id, token) for r in need}
    return out, sched.update_from_output(out, sampled)


def test_admission_takes_the_lowest_free_slot_in_fifo_order():
    sched = Scheduler(num_slots=3, max_waiting=10, token_budget=16)
    for i in range(4):
        sched.add(make_request(f"r{i}"))
    sched.schedule()
    assert [sched.slot_owner(s).request_id for s in range(3)] == ["r0", "r1", "r2"]
    assert [r.request_id for r in sched.waiting] == ["r3"]
    sched.abort(["r1"])
    assert sched.num_free_slots == 1
    sched.schedule()
    assert sched.slot_owner(1).request_id == "r3"


def test_waiting_queue_bound():
    sched = Scheduler(num_slots=1, max_waiting=2, token_budget=8)
    sched.add(make_request("a"))
    sched.add(make_request("b"))
    with pytest.raises(EngineOverloadedError):
        sched.add(make_request("c"))
    sched.schedule()  # "a" takes the slot, one place frees up
    sched.add(make_request("c"))


def test_chunked_prefill_within_budget_and_decode_first():
    sched = Scheduler(num_slots=4, max_waiting=10, token_budget=10)
    sched.add(make_request("short", prompt_len=3))
    out, _ = step(sched)
    assert out.prefill.num_tokens == 3 and out.prefill.is_last and not out.decode
    sched.add(make_request("long", prompt_len=25))
    chunks = []
    while True:
        out, _ = step(sched)
        assert out.num_tokens <= 10
        if out.prefill is None:
            assert [r.request_id for r in out.decode] == ["short", "long"]
            break
        assert [r.request_id for r in out.decode] == ["short"]  # the running stream never stalls
        chunks.append((out.prefill.start, out.prefill.num_tokens))
    assert chunks == [(0, 9), (9, 9), (18, 7)]
    long = sched.running["long", 0]
    assert long.num_computed_tokens == 26 and len(long.output_ids) == 2  # prompt + one decode step


def test_one_prefill_per_step_oldest_first_when_asked():
    sched = Scheduler(num_slots=4, max_waiting=10, token_budget=32, max_prefills=1)
    sched.add(make_request("a", prompt_len=3))
    sched.add(make_request("b", prompt_len=3))
    out, _ = step(sched)
    assert out.prefill.request.request_id == "a" and not out.more_prefills
    out, _ = step(sched)
    assert out.prefill.request.request_id == "b" and [r.request_id for r in out.decode] == ["a"]


def test_requests_arriving_together_prefill_in_one_step():
    """Eight short prompts arrive at once beside nothing running: all eight chunks share the first step, oldest
    first, and every request has its first token after it (vLLM's budget rule, not a step each)."""
    sched = Scheduler(num_slots=8, max_waiting=10, token_budget=64)
    for i in range(8):
        sched.add(make_request(f"r{i}", prompt_len=6))
    out, _ = step(sched)
    assert [c.request.request_id for c in out.prefills] == [f"r{i}" for i in range(8)]
    assert out.prefill is out.prefills[0] and out.num_tokens == 48 <= 64
    assert all(len(sched.running[f"r{i}", 0].output_ids) == 1 for i in range(8))
    out, _ = step(sched)
    assert len(out.decode) == 8 and not out.prefills


def test_prefill_chunks_share_what_decode_leaves_of_the_budget():
    """Two streams decode; three prompts wait. The budget (24) minus the decode tokens (2) goes to the
    oldest prompt first; a younger one gets a chunk only while it finishes its prompt or is long enough to be
    worth a run of its own (MIN_EXTRA_CHUNK), and the decode rows never wait."""
    from engine.scheduler import MIN_EXTRA_CHUNK

    sched = Scheduler(num_slots=5, max_waiting=10, token_budget=24)
    sched.add(make_request("s0", prompt_len=3, max_tokens=50))
    sched.add(make_request("s1", prompt_len=3, max_tokens=50))
    step(sched)
    sched.add(make_request("long", prompt_len=30, max_tokens=50))
    sched.add(make_request("short", prompt_len=5, max_tokens=50))
    sched.add(make_request("tiny", prompt_len=2, max_tokens=50))
    out, _ = step(sched)
    assert [r.request_id for r in out.decode] == ["s0", "s1"]
    assert [(c.request.request_id, c.num_tokens) for c in out.prefills] == [("long", 22)]
    assert out.num_tokens == 24
    out, _ = step(sched)  # long's last 8 tokens, then short and tiny whole: 2 + 8 + 5 + 2 = 17
    assert [(c.request.request_id, c.num_tokens, c.is_last) for c in out.prefills] == [
        ("long", 8, True), ("short", 5, True), ("tiny", 2, True)]
    assert out.num_tokens <= 24
    # a younger prompt that can't finish gets no sliver below MIN_EXTRA_CHUNK
    sched2 = Scheduler(num_slots=3, max_waiting=10, token_budget=MIN_EXTRA_CHUNK + 10)
    sched2.add(make_request("a", prompt_len=MIN_EXTRA_CHUNK, max_model_len=400))
    sched2.add(make_request("b", prompt_len=3 * MIN_EXTRA_CHUNK, max_model_len=400))
    out, _ = step(sched2)
    assert [(c.request.request_id, c.num_tokens) for c in out.prefills] == [("a", MIN_EXTRA_CHUNK)]


def test_decode_batch_is_sorted_by_slot():
    sched = Scheduler(num_slots=4, max_waiting=10, token_budget=32)
    for rid in "abcd":
        sched.add(make_request(rid, prompt_len=2))
    for _ in range(4):
        step(sched)
    sched.abort(["b"])
    out, _ = step(sched)
    assert [r.slot for r in out.decode] == [0, 2, 3]


def test_stops_eos_stop_ids_max_tokens_and_context():
    sched = Scheduler(num_slots=4, max_waiting=10, token_budget=32)
    sched.add(make_request("eos"))
    sched.add(make_request("ignore", ignore_eos=True, max_tokens=3))
    sched.add(make_request("stopid", stop_token_ids=(7,)))
    sched.add(make_request("ctx", prompt_len=6, max_tokens=100, max_model_len=9))
    reasons = {}
    for _ in range(12):
        _, finished = step(sched, tokens={"eos": EOS, "ignore": EOS, "stopid": 7})
        reasons.update({f.request.request_id: (f.reason, len(f.request.output_ids)) for f in finished})
    assert reasons == {"eos": (FinishReason.STOP, 1), "ignore": (FinishReason.LENGTH, 3),
                       "stopid": (FinishReason.STOP, 1), "ctx": (FinishReason.LENGTH, 3)}
    assert sched.num_free_slots == 4 and not sched.has_work


def test_request_bookkeeping_invariant():
    sched = Scheduler(num_slots=2, max_waiting=10, token_budget=8)
    sched.add(make_request("a", prompt_len=5, max_tokens=4))
    seen = []
    while sched.has_work:
        out, _ = step(sched)
        for r in out.decode:
            seen.append(r.num_computed_tokens == r.num_tokens - 1)
    assert seen and all(seen)


def test_random_submit_and_abort_sequences_leave_no_slot_in_use():
    rng = random.Random(0)
    for trial in range(100):
        sched = Scheduler(num_slots=4, max_waiting=6, token_budget=12)
        live = []
        for i in range(rng.randint(1, 30)):
            action = rng.random()
            if action < 0.5:
                try:
                    sched.add(make_request(f"{trial}-{i}", prompt_len=rng.randint(1, 20),
                                           max_tokens=rng.randint(1, 6)))
                    live.append(f"{trial}-{i}")
                except EngineOverloadedError:
                    pass
            elif action < 0.7 and live:
                sched.abort([live.pop(rng.randrange(len(live)))])
            else:
                step(sched, token=rng.choice([5, 6, EOS]))
            in_use = {r.slot for r in sched.running.values()}
            assert len(in_use) == len(sched.running) == 4 - sched.num_free_slots
        while sched.has_work and rng.random() < 0.5:
            step(sched)
        sched.abort(live)
        assert not sched.has_work and sched.num_free_slots == 4
