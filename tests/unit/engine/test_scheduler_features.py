"""Prefix reuse, n > 1 and speculative drafts in the scheduler, the prefix cache and the drafter (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.prefix_cache import KVCopy, SlotPrefixCache, common_prefix_len
from engine.sampler import RequestSampler
from engine.scheduler import Request, Scheduler
from engine.speculative import MAX_SKIP_STEPS, NgramDrafter, best_draft_length
from engine.types import FinishReason, SamplingParams, StructuredOutput

EOS = 2


def make_request(rid, prompt, max_tokens=8, max_model_len=256, n=1, **params):
    request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                      eos_token_ids=frozenset({EOS}), max_model_len=max_model_len)
    if n > 1:
        request.fork(n)
    return request


def step(sched, tokens=None, default=5):
    """One scripted step; ``tokens`` maps a request id to what it gets (a list for a draft check)."""
    out = sched.schedule()
    sampled = {}
    for r in out.decode:
        sampled[r] = (tokens or {}).get(r.request_id, default)
    for v in out.verify:
        sampled[v.request] = (tokens or {}).get(v.request.request_id, [default])
    for chunk in out.prefills:
        if chunk.is_last:
            for r in (chunk.request, *chunk.request.forks):
                sampled[r] = (tokens or {}).get(r.request_id, default)
    return out, sched.update_from_output(out, sampled)


def run_to_end(sched, **kw):
    finished = []
    while sched.has_work:
        finished += step(sched, **kw)[1]
    return finished


# -- prefix cache ------------------------------------------------------------------------------------


@pytest.mark.parametrize("a, b, expected", [
    ([], [1, 2], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2, 4], 2), ([5], [6], 0),
    (list(range(1000)), list(range(999)) + [-1], 999), (list(range(1000)), list(range(10)) + [-1], 10),
])
def test_common_prefix_len(a, b, expected):
    assert common_prefix_len(a, b, 10**6) == expected
    assert common_prefix_len(b, a, 10**6) == expected
    assert common_prefix_len(a, b, 1) == min(1, expected)


def test_a_finished_prompt_is_reused_by_a_continuation_in_the_same_slot():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=64, prefix_caching=True)
    first = make_request("a", range(10, 40), max_tokens=4)
    sched.add(first)
    run_to_end(sched)
    assert sched.cache.cached(first.slot) == first.computed_ids  # prompt + 3 of the 4 outputs
    assert len(first.computed_ids) == 30 + 3
    turn2 = make_request("b", first.prompt_ids + first.output_ids + [99, 98])
    sched.add(turn2)
    out, _ = step(sched)
    assert turn2.slot == first.slot and turn2.num_cached_tokens == 33
    assert out.prefill.start == 33 and out.prefill.num_tokens == 36 - 33 and not out.copies
    assert (sched.prefix_queries_total, sched.prefix_hits_total) == (30 + 36, 33)


def test_the_last_two_prompt_tokens_always_run_and_no_chunk_is_a_lone_last_token():
    sched = Scheduler(num_slots=1, max_waiting=4, token_budget=64, prefix_caching=True)
    sched.add(make_request("a", range(10, 20), max_tokens=1))
    run_to_end(sched)
    again = make_request("b", range(10, 20))
    sched.add(again)
    out, _ = step(sched)
    assert again.num_cached_tokens == 8 and (out.prefill.start, out.prefill.num_tokens) == (8, 2)
    chunked = Scheduler(num_slots=1, max_waiting=4, token_budget=8)
    chunked.add(make_request("c", range(10, 27)))  # 17 tokens at 8 a step: 8, 7, 2 rather than 8, 8, 1
    assert [step(chunked)[0].prefill.num_tokens for _ in range(3)] == [8, 7, 2]


def test_off_means_lowest_slot_and_nothing_reused():
    sched = Scheduler(num_slots=3, max_waiting=4, token_budget=64, prefix_caching=False)
    sched.add(make_request("a", range(10, 20), max_tokens=1))
    run_to_end(sched)
    again = make_request("b", range(10, 30))
    sched.add(again)
    step(sched)
    assert again.slot == 0 and again.num_cached_tokens == 0 and sched.prefix_hits_total == 0


def test_a_short_match_does_not_evict_a_long_cache_lru_and_empty_slots_go_first():
    cache = SlotPrefixCache(3, enabled=True, can_copy=False)
    cache.keep(1, [7, 8, 9])  # an older, shorter conversation
    cache.keep(0, list(range(100)))  # a long one
    # Shares 5 tokens with slot 0 (5% of it): slot 0 keeps its cache, the empty slot 2 is taken.
    p = cache.place(list(range(5)) + [-1], [0, 1, 2])
    assert p.slot == 2 and p.num_reused == 0
    # No empty slot: the least recently used one (1) is the victim.
    assert cache.place([50, 51], [0, 1]).slot == 1
    # A continuation of slot 0 takes it.
    assert cache.place(list(range(120)), [0, 1, 2]) == type(p)(0, 100)


def test_a_longer_prefix_elsewhere_is_copied_where_rows_are_host_memory():
    cache = SlotPrefixCache(3, enabled=True, can_copy=True)
    cache.keep(0, list(range(100)))
    prompt = list(range(40)) + [-1, -2]  # 40 tokens in common with slot 0, under half of what it holds
    p = cache.place(prompt, [0, 1, 2])
    assert (p.slot, p.num_reused, p.copy) == (1, 40, KVCopy(0, 1, 0, 40))
    # more than half in common, but not all of it: still copied, slot 0 keeps its whole conversation
    p = cache.place(list(range(90)) + [-1, -2], [0, 1, 2])
    assert (p.slot, p.num_reused, p.copy) == (1, 90, KVCopy(0, 1, 0, 90))
    # from a running request (slot 2, 40 valid tokens): copied too
    p = cache.place(list(range(30)) + [-1, -2], [1], running=[(2, list(range(50)), 40)])
    assert (p.slot, p.num_reused, p.copy) == (1, 30, KVCopy(2, 1, 0, 30))
    # opaque rows: only a slot's own prefix
    opaque = SlotPrefixCache(3, enabled=True, can_copy=False)
    opaque.keep(0, list(range(100)))
    assert opaque.place(prompt, [0, 1, 2]) == type(p)(1, 0)


def test_a_match_shorter_than_min_reuse_counts_as_none():
    cache = SlotPrefixCache(3, enabled=True, can_copy=True, min_reuse=8)
    cache.keep(0, list(range(100)))
    # 5 tokens in common with slot 0 and 7 with a running request: neither is worth it, no copy
    p = cache.place(list(range(5)) + [-1, -2], [0, 1, 2], running=[(2, list(range(7)) + [9], 8)])
    assert (p.num_reused, p.copy) == (0, None)
    # 7 tokens of a running request, 8 of a free slot: the free slot's 8 are (copied into an empty slot)
    p = cache.place(list(range(8)) + [-1, -2], [0, 1], running=[(2, list(range(7)) + [9], 8)])
    assert (p.slot, p.num_reused, p.copy) == (1, 8, KVCopy(0, 1, 0, 8))
    # a continuation of slot 0 takes it in place, as with any match
    assert cache.place(list(range(120)), [0, 1, 2]) == type(p)(0, 100)


def test_a_short_shared_prefix_leaves_the_prompt_whole_where_prompts_run_together():
    """Distinct prompts that share their first tokens with a running request (as a bench's do) prefill from
    position 0 (so they can join a batched prompt run) when the match is under ``min_prefix_reuse``."""
    for min_reuse, start in ((1, 3), (4, 0)):
        sched = Scheduler(num_slots=2, max_waiting=4, token_budget=64, prefix_caching=True, can_copy=True,
                          min_prefix_reuse=min_reuse)
        sched.add(make_request("a", [10, 11, 12, 1, 2], max_tokens=20))
        step(sched)
        sched.add(make_request("b", [10, 11, 12, 3, 4, 5]))
        out, _ = step(sched)
        assert out.prefill.start == start and bool(out.copies) == (start > 0)


def test_a_request_copies_the_prompt_of_a_running_one():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=64, prefix_caching=True, can_copy=True)
    system = list(range(10, 50))
    sched.add(make_request("a", system + [1, 2], max_tokens=20))
    step(sched)  # "a" prefilled
    b = make_request("b", system + [3, 4, 5])
    sched.add(b)
    out, _ = step(sched)
    assert out.copies == (KVCopy(0, 1, 0, 40),) and b.num_cached_tokens == 40
    assert (out.prefill.start, out.prefill.num_tokens) == (40, 3)


# -- n > 1 -------------------------------------------------------------------------------------------


def test_choices_wait_for_n_free_slots_share_one_prefill_and_then_decode_apart():
    sched = Scheduler(num_slots=3, max_waiting=4, token_budget=10, prefix_caching=True, can_copy=True)
    sched.add(make_request("busy", range(10, 12), max_tokens=3))
    group = make_request("g", range(10, 25), max_tokens=3, n=3)
    sched.add(group)
    out, _ = step(sched)
    assert group.slot is None and out.prefill.request.request_id == "busy"  # 2 slots free, 3 needed
    prefills = []
    while group.slot is None or group.in_prefill:
        out, _ = step(sched, tokens={"g": 7})
        if out.prefill is not None:
            prefills.append(out.prefill)
            assert out.prefill.request is group  # forks never prefill on their own
        assert not any(r.request_id == "g" for r in out.decode)
    assert sum(c.num_tokens for c in prefills) == 15 - group.num_cached_tokens
    assert len({c.slot for c in (group, *group.forks)}) == 3
    assert group.num_cached_tokens == 2  # "busy" left [10, 11, ...] in its slot
    for choice in (group, *group.forks):
        assert choice.output_ids == [7] and choice.num_computed_tokens == 15
    out, _ = step(sched, tokens={"g": 8})
    assert sorted(r.index for r in out.decode) == [0, 1, 2]
    finished = run_to_end(sched)
    assert sorted(f.request.index for f in finished) == [0, 1, 2]


def test_one_choice_can_be_aborted_alone():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=32)
    group = make_request("g", range(10, 14), max_tokens=5, n=2)
    sched.add(group)
    step(sched)
    dropped = sched.abort(["g"], index=1)
    assert [r.index for r in dropped] == [1] and list(sched.running) == [("g", 0)]
    assert [r.index for r in sched.abort(["g"])] == [0] and not sched.has_work


def test_forks_copy_a_reused_prefix_from_choice_0():
    sched = Scheduler(num_slots=4, max_waiting=4, token_budget=64, prefix_caching=True, can_copy=True)
    sched.add(make_request("a", range(10, 30), max_tokens=1))
    run_to_end(sched)
    group = make_request("g", list(range(10, 30)) + [1, 2], n=3)
    sched.add(group)
    out, _ = step(sched)
    assert group.num_cached_tokens == 20
    assert set(out.copies) == {KVCopy(group.slot, f.slot, 0, 20) for f in group.forks}


# -- speculative decoding ----------------------------------------------------------------------------


def test_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(max_tokens=4, prior=(1.0, 1.0))  # as if every draft so far was accepted
    prompt = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8]
    assert drafter.propose(prompt, [], limit=10) == ()  # the suffix (7, 8) never came before
    assert drafter.propose(prompt, [9, 2, 3], limit=10) == (7, 8, 9, 2)  # (2, 3) last followed by 7
    assert drafter.propose(prompt, [9, 2, 3], limit=2) == (7, 8)
    drafter = NgramDrafter(max_tokens=4, prior=(1.0, 1.0))
    assert drafter.propose([5, 1, 2, 9, 9, 1, 2, 3, 0, 0, 1, 2], [], limit=10) == (3, 0, 0, 1)  # 3-gram first
    assert NgramDrafter(max_tokens=4).propose([1, 2, 3, 1, 2], [], limit=10) == (3,)  # a fresh request: 1 token


def test_draft_length_pays_for_itself_at_the_acceptance_rate():
    lengths = [best_draft_length(a / 100, 16) for a in range(0, 101, 5)]
    assert lengths == sorted(lengths)  # longer drafts only as acceptance rises
    assert best_draft_length(0.3, 16) == 0 and best_draft_length(0.5, 16) == 1 and best_draft_length(1.0, 16) == 16
    assert best_draft_length(0.99, 4) == 4


def test_drafter_grows_while_drafts_are_kept_and_backs_off_when_they_are_not():
    drafter = NgramDrafter(max_tokens=16)
    tokens = [1, 2, 3] * 10
    grown = []
    for _ in range(6):  # every draft fully accepted (copied text)
        draft = drafter.propose(tokens, [], 99)
        grown.append(len(draft))
        drafter.record(len(draft), len(draft))
    assert grown[0] == 1 and grown == sorted(grown) and grown[-1] == 16  # a fresh request starts short
    drafter.record(16, 3)  # the copy ends: the length falls at once
    assert 1 <= drafter.num_tokens < 16
    checks = []
    for _ in range(300):  # from now on every draft is rejected outright (free text the lookup misreads)
        draft = drafter.propose(tokens, [], 99)
        if draft:
            checks.append(len(draft))
            drafter.record(len(draft), 0)
    assert len(checks) <= 15 and checks[-1] == 1  # few checks, pausing longer and longer (up to MAX_SKIP_STEPS)
    assert drafter._skip <= MAX_SKIP_STEPS
    grown = []
    for _ in range(200):  # and drafts are kept again: the length grows back
        draft = drafter.propose(tokens, [], 99)
        if draft:
            grown.append(len(draft))
            drafter.record(len(draft), len(draft))
    assert grown[-1] == 16


def test_a_copy_that_ends_caps_the_next_draft_at_what_was_kept_and_a_kept_draft_doubles_it():
    drafter = NgramDrafter(max_tokens=16, prior=(16.0, 16.0))  # a long copy so far: the estimate pays for 16
    tokens = [1, 2, 3] * 10
    assert len(drafter.propose(tokens, [], 99)) == 16
    drafter.record(16, 5)  # the copy ended at the draft's 6th token (a changed line)
    assert drafter.acceptance_rate > 0.9 and drafter.num_tokens > 6  # the estimate alone would still draft long
    assert len(drafter.propose(tokens, [], 99)) == 6  # one past what was kept
    drafter.record(6, 0)  # nothing kept: the next is one token (after the back-off's pause)
    lengths = []
    for _ in range(20):
        draft = drafter.propose(tokens, [], 99)
        if draft:
            lengths.append(len(draft))
            drafter.record(len(draft), len(draft))  # the copy goes on: each draft kept whole
    assert lengths[:4] == [1, 2, 4, 8] and lengths[4] > 8  # (below what the estimate pays for)


def spec_scheduler(**kw):
    return Scheduler(num_slots=2, max_waiting=4, token_budget=32, speculative_tokens=4, **kw)


def test_a_lone_decoding_request_checks_drafts_and_advances_by_what_was_accepted():
    sched = spec_scheduler()
    r = make_request("a", [1, 2, 3, 4, 5, 1, 2], max_tokens=20, ignore_eos=True)  # (2 is EOS here)
    sched.add(r)
    step(sched, tokens={"a": 3})  # prefill samples 3: tokens end (1, 2, 3), seen before, followed by 4, 5, 1, 2
    out = sched.schedule()
    assert not out.decode and [(v.request, v.draft) for v in out.verify] == [(r, (4,))]  # a fresh request: 1
    assert out.verify[0].token_ids == [3, 4] and out.num_tokens == 2
    sched.update_from_output(out, {r: [4, 5]})  # accepted, plus the model's own next token
    out = sched.schedule()
    assert [v.draft for v in out.verify] == [(1, 2, 3)]  # (4, 5) came before: the draft grew
    before = r.num_computed_tokens
    sched.update_from_output(out, {r: [1, 2, 9]})  # two accepted, then the model's own 9
    assert r.output_ids == [3, 4, 5, 1, 2, 9] and r.num_computed_tokens == before + 3 == r.num_tokens - 1
    assert (r.drafter.num_drafted, r.drafter.num_accepted) == (4, 3)


def test_drafts_stop_at_max_tokens_and_a_stop_token_inside_them_ends_the_request():
    sched = spec_scheduler()
    r = make_request("a", [1, 2, 3, 4, 5, 1, 2], max_tokens=3)
    sched.add(r)
    step(sched, tokens={"a": 3})
    out = sched.schedule()
    assert out.verify[0].draft == (4,)  # 2 tokens left: a draft of 1, the check adds at most 2
    finished = sched.update_from_output(out, {r: [4, 5]})
    assert finished[0].reason is FinishReason.LENGTH and r.output_ids == [3, 4, 5]
    sched = spec_scheduler()
    r = make_request("b", [1, 2, 3, EOS, 5, 1, 2], max_tokens=20)
    sched.add(r)
    step(sched, tokens={"b": 3})
    out = sched.schedule()
    finished = sched.update_from_output(out, {r: [EOS, 5]})
    assert finished[0].reason is FinishReason.STOP and r.output_ids == [3, EOS] and not sched.has_work


def decoding_pair(sched):
    """Two requests in decode, both with a draft available (prefilled with drafting off, one step each)."""
    speculative_tokens, sched.speculative_tokens = sched.speculative_tokens, 0
    max_prefills, sched.max_prefills = sched.max_prefills, 1
    for rid in ("a", "b"):
        sched.add(make_request(rid, [1, 2, 3, 4, 5, 1, 2], max_tokens=20))
    step(sched, tokens={"a": 3, "b": 3})
    step(sched, tokens={"a": 4, "b": 3})  # a: (3, 4) came before; b: (2, 3) did
    sched.speculative_tokens, sched.max_prefills = speculative_tokens, max_prefills
    return sched


class ScriptedGrammar:
    """What the scheduler asks of a constrained request's grammar: how many of a draft's tokens it allows."""

    def __init__(self, num_allowed: int) -> None:
        self.num_allowed = num_allowed
        self.asked: list[tuple[int, ...]] = []

    def allows(self, token_ids) -> int:
        self.asked.append(tuple(token_ids))
        return min(self.num_allowed, len(token_ids))


def test_no_drafts_beside_other_streams_or_when_off_and_structured_drafts_stop_where_the_grammar_forbids():
    assert not decoding_pair(spec_scheduler()).schedule().verify  # two decode together: one batched run
    out = decoding_pair(spec_scheduler(speculative_max_batch=2)).schedule()
    assert [v.draft for v in out.verify] == [(5,), (4,)] and not out.decode
    for allowed, expected in ((0, ()), (1, (4,))):
        structured = spec_scheduler()
        request = make_request("s", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], max_tokens=20,
                               structured=StructuredOutput("regex", "[0-9]+"))
        request.constraint = ScriptedGrammar(allowed)
        structured.add(request)
        step(structured, tokens={"s": 3})
        out = structured.schedule()
        assert request.constraint.asked == [(4,)]  # the grammar was asked about the lookup's draft
        assert [v.draft for v in out.verify] == ([expected] if expected else [])
        assert out.decode == (() if expected else (request,))  # no draft left: it decodes with the others
    off = Scheduler(num_slots=2, max_waiting=4, token_budget=32)
    off.add(make_request("a", [1, 2, 3, 4, 5, 1, 2], max_tokens=20))
    step(off, tokens={"a": 3})
    assert not off.schedule().verify


# -- sampler: the draft check ------------------------------------------------------------------------


def test_verify_keeps_the_draft_prefix_the_model_would_have_chosen():
    logits = np.full((4, 6), -5.0, dtype=np.float32)
    for row, best in enumerate([3, 4, 1, 2]):
        logits[row, best] = 5.0
    greedy = RequestSampler(SamplingParams(temperature=0.0), [0], 6)
    assert [r.token_id for r in greedy.verify(logits, [3, 4, 0])] == [3, 4, 1]  # two kept, then the model's 1
    assert [r.token_id for r in greedy.verify(logits, [3, 4, 1])] == [3, 4, 1, 2]  # all kept plus a bonus
    assert [r.token_id for r in greedy.verify(logits, [0, 4, 1])] == [3]


def test_verify_draws_as_plain_sampling_does_so_seeded_text_is_the_same():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=42, presence_penalty=0.5, logit_bias=((3, 2.0),))
    plain = RequestSampler(params, [1, 2, 3], 50)
    expected = []
    for row in logits:
        expected.append(plain.sample(row).token_id)
        plain.record(expected[-1])
    checked = RequestSampler(params, [1, 2, 3], 50)
    got = [r.token_id for r in checked.verify(logits, expected[:4])]
    assert got == expected  # every draft token is what plain sampling picks, so all are kept
    wrong = RequestSampler(params, [1, 2, 3], 50)
    draft = [expected[0], (expected[1] + 1) % 50, 0, 0]
    assert [r.token_id for r in wrong.verify(logits, draft)] == expected[:2]
    a, b = RequestSampler(params, [1, 2, 3], 50), RequestSampler(params, [1, 2, 3], 50)
    a.verify(logits, draft)
    for row in logits[:2]:
        b.record(b.sample(row).token_id)
    assert a.rng.random() == b.rng.random()  # one draw per emitted token, as plain decoding


# -- arrivals: whole prompts beside the token budget ------------------------------------------------------------


def test_a_burst_of_short_prompts_takes_the_prompt_budget_in_one_step():
    sched = Scheduler(num_slots=64, max_waiting=64, token_budget=256, prompt_budget=2048, batched_prompt_len=257)
    burst = [make_request(f"r{i}", range(3, 3 + 40)) for i in range(64)]
    for r in burst:
        sched.add(r)
    out = sched.schedule()
    # 51 whole prompts of 40 tokens fit 2,048; the next ones take the token budget (whole too: 6 of 40 fit 256)
    whole = [c for c in out.prefills if c.start == 0 and c.is_last]
    assert len(out.prefills) == len(whole) == 51 + 6
    assert [c.request for c in out.prefills] == burst[:57]  # oldest first
    sched.update_from_output(out, {c.request: 5 for c in out.prefills})
    out = sched.schedule()
    assert len(out.decode) == 57 and [c.request for c in out.prefills] == burst[57:]


def test_long_prompts_prefixes_and_choices_stay_within_the_token_budget():
    sched = Scheduler(num_slots=8, max_waiting=8, token_budget=64, prompt_budget=2048, batched_prompt_len=33)
    long_one = make_request("long", range(3, 3 + 100))
    n2 = make_request("n2", range(3, 3 + 10), n=2)
    short = make_request("short", range(3, 3 + 20))
    for r in (long_one, n2, short):
        sched.add(r)
    out = sched.schedule()
    chunks = {c.request.request_id: (c.start, c.num_tokens) for c in out.prefills}
    assert chunks["short"] == (0, 20)  # from the prompt budget
    assert chunks["long"] == (0, 64)  # the token budget, as before
    assert "n2" not in chunks  # (n > 1 runs on its own path: what the token budget leaves, nothing here)
