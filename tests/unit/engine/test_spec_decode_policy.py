"""Which source drafts for a row (prompt lookup, the draft model) and how many tokens: the scheduler's choice and
the draft model's per-request state, with scripted outputs (no model)."""

from __future__ import annotations

from engine.scheduler import Request, Scheduler, Verify
from engine.spec_decode.policy import (FREE_PROBE_HORIZON, FREE_PROBE_SHARE, FREE_PROBE_STEPS, GAIN_PRIOR, PROBE_SHARE,
                                      PROBE_TOKENS, ModelDraftState, best_length, expected_tokens)
from engine.spec_decode.proposer import DRAFT_MODEL, DraftRow
from engine.speculative import CheckCost, NgramDrafter
from engine.types import SamplingParams, StructuredOutput

EOS = 2


def make_request(rid, prompt, max_tokens=40, **params):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   eos_token_ids=frozenset({EOS}), max_model_len=256)


def decoding(sched, request, first=3):
    sched.add(request)
    out = sched.schedule()
    sched.update_from_output(out, {request: first})
    return request


def test_expected_tokens_and_best_length_on_exact_numbers():
    assert expected_tokens(0.5, 3) == 1 + 0.5 + 0.25 + 0.125
    assert best_length(0.0, 8, lambda d: 1.0 + d) == (0, 1.0)  # nothing is kept: no draft pays
    num, gain = best_length(0.9, 8, lambda d: 1.0 + 0.1 * d)  # cheap checks, good drafts: long drafts
    assert num == 8 and abs(gain - expected_tokens(0.9, 8) / 1.8) < 1e-12


def test_a_request_without_lookup_matches_drafts_with_the_draft_model():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=64, speculative_tokens=4)
    sched.use_draft_model(8)
    sched.check_cost.freeze()
    r = decoding(sched, make_request("a", range(10, 30)))  # no n-gram repeats: prompt lookup has nothing
    r.model_draft = ModelDraftState(prior=(9.0, 10.0), gain_prior=3.0)  # as if 90% were kept, 3 tokens a step
    out = sched.schedule()
    assert not out.decode and not out.verify
    assert [(d.request, d.num_tokens > 1) for d in out.draft_rows] == [(r, True)]
    assert out.num_tokens == out.draft_rows[0].num_tokens + 1
    k = out.draft_rows[0].num_tokens
    # the core checks the draft model's draft as a Verify; acceptance goes to the draft model's state
    sched.update_from_output(type(out)(None, (), (Verify(r, tuple(range(40, 40 + k)), None, DRAFT_MODEL),)),
                             {r: [40, 41, 7]})
    assert (r.model_draft.num_drafted, r.model_draft.num_accepted) == (k, 2) and r.drafter.num_drafted == 0


def test_a_draft_model_row_decodes_plainly_until_the_decode_step_is_measured():
    """Costs are priced in plain decode steps: a row that drafted from its first step never measured one (an H100 kept
    the CPU's priors and halved its speed with drafts it kept whole). Until three lone steps are measured the rows
    decode plainly; then the row drafts."""
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=64, speculative_tokens=4)
    sched.use_draft_model(8)
    r = decoding(sched, make_request("a", range(10, 30)))
    r.model_draft = ModelDraftState(prior=(9.0, 10.0), gain_prior=3.0)
    for i in range(3):
        out = sched.schedule()
        assert out.decode == (r,) and not out.draft_rows and not out.verify
        sched.update_from_output(out, {r: 40 + i})
        sched.check_cost.record_decode(0.05)  # (the core times each lone decode step)
    out = sched.schedule()
    assert [d.request for d in out.draft_rows] == [r]


def test_a_copying_request_takes_prompt_lookup_and_a_poor_draft_model_is_left_alone():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=64, speculative_tokens=8)
    sched.use_draft_model(8)
    sched.check_cost.freeze()
    r = decoding(sched, make_request("a", [5, 6, 7, 8, 9, 10, 11, 5, 6]), first=7)  # (6, 7) seen: lookup drafts
    r.model_draft = ModelDraftState(prior=(0.5, 10.0), gain_prior=0.7)  # rarely kept: they cost more than they give
    r.model_draft.num_probes = 1  # (its first probe is behind it, and its probe credit is empty: not probing)
    out = sched.schedule()
    assert not out.draft_rows and [v.draft[:1] for v in out.verify] == [(8,)]


def test_rows_that_turned_drafts_off_do_not_draft_and_constrained_rows_draft_with_the_draft_model():
    sched = Scheduler(num_slots=3, max_waiting=4, token_budget=64, speculative_tokens=4,
                      speculative_max_batch=3)
    sched.use_draft_model(8)
    sched.check_cost.freeze()
    grammar = make_request("g", range(10, 20), structured=StructuredOutput("json_object"))
    off = make_request("o", range(30, 40), draft_max_tokens=0)
    capped = make_request("c", range(50, 60), draft_max_tokens=2)
    for r in (grammar, off, capped):
        sched.add(r)
    out = sched.schedule()
    sched.update_from_output(out, {c.request: 3 for c in out.prefills})
    capped.model_draft = ModelDraftState(prior=(9.9, 10.0), gain_prior=3.0)
    grammar.model_draft = ModelDraftState(prior=(9.9, 10.0), gain_prior=3.0)
    out = sched.schedule()
    assert set(out.decode) == {off}
    # the request's own bound (llama.cpp's speculative.n_max); a constrained row drafts inside its grammar (the core
    # masks the draft model's logits with it: engine.constraint_masks)
    assert out.draft_rows == (DraftRow(grammar, 8), DraftRow(capped, 2))


def test_a_row_whose_drafts_keep_missing_drafts_fewer_then_probes_out_of_a_bounded_credit():
    cost = CheckCost()
    cost.freeze()
    state = ModelDraftState()
    lengths = []
    for _ in range(6):
        num, _ = state.plan(16, cost)
        lengths.append(num)
        if num:
            state.record(num, 0)
    assert lengths[0] >= 1 and lengths[-1] == 0  # fewer, then none
    # failed probes (each priced with its catch-up: a row resuming after plain steps) take ~PROBE_SHARE of the time
    probe = cost.draft_steps(PROBE_TOKENS) + cost.steps(PROBE_TOKENS) + cost.resume_steps(0) - 1.0
    probes = plain = 0
    for _ in range(400):
        num, _ = state.plan(16, cost)
        if num:
            probes += 1
            state.record(num, 0)
        else:
            plain += 1
    assert probes >= 2 and probes * probe <= PROBE_SHARE * plain + probe


def test_a_probe_kept_whole_gives_its_credit_back():
    cost = CheckCost()
    cost.freeze()
    state = ModelDraftState(prior=(0.5, 10.0), gain_prior=0.7)
    assert state.plan(16, cost)[0] == PROBE_TOKENS  # the first probe is free
    state.record(PROBE_TOKENS, 0)
    waits, plain = [], 0
    for kept in (0, PROBE_TOKENS, 0):
        while not state.plan(16, cost)[0]:
            plain += 1
        waits.append(plain)
        plain = 0
        state.record(PROBE_TOKENS, kept)
    assert waits[1] > 0 and waits[2] < waits[1]  # after the kept one, the next probe comes sooner


def test_a_long_prompts_first_draft_comes_when_the_answer_left_is_long_enough_to_repay_its_catch_up():
    cost = CheckCost()
    cost.freeze()
    prompt = 253  # a code edit's prompt: the draft row catches it all up before its first token
    catch_up = cost.resume_steps(prompt)
    saved = (1 - 1 / GAIN_PRIOR) * 128  # the steps drafts at the prior's gain save over 128 tokens
    assert FREE_PROBE_STEPS < catch_up <= saved  # (the prior law's price of that catch-up)
    assert ModelDraftState().plan(16, cost, prompt, num_left=128)[0] == 16  # 128 tokens to go: a whole draft
    assert ModelDraftState().plan(16, cost, prompt, num_left=16)[0] == 0  # 16 to go: paid, out of a credit of 0
    assert ModelDraftState().plan(16, cost, prompt)[0] == 0  # (nothing known of what is left: the old rule)
    # a row that did not draft lately: a catch-up that the rest of the answer repays, else probes out of the credit
    state = ModelDraftState()
    state.drafted_at = prompt
    assert state.plan(16, cost, prompt + 30, num_left=100)[0] == 16
    assert state.plan(16, cost, prompt + 30, num_left=3)[0] == PROBE_TOKENS  # 3 to go: a probe (its first, free)
    long_prompt = 10_000  # an agent's: more than the longest answer counted could repay
    assert cost.resume_steps(long_prompt) > FREE_PROBE_SHARE * FREE_PROBE_HORIZON
    assert ModelDraftState().plan(16, cost, long_prompt, num_left=30_000)[0] == 0


def test_a_drafts_first_token_costs_its_catch_up_and_a_resume_costs_more():
    cost = CheckCost()
    cost.record_decode(0.070)
    cost.record_draft(first_s=0.055, num_rows=1, later_s=0.081, num_later=3)  # a 2-token chunk, then 3 decode runs
    cost.record_resume(0.090, 9)  # 9 tokens behind: 7 more than a steady draft's catch-up
    assert abs(cost.draft_steps(4) - (0.055 + 3 * 0.027) / 0.070) < 1e-9
    assert abs(cost.resume_steps(9) - (0.090 - 0.055) / 0.070) < 1e-9
    assert abs(cost.resume_steps(16) - 2 * cost.resume_steps(9)) < 1e-9 and cost.resume_steps(2) == 0.0


def test_prompt_lookup_is_scored_against_the_draft_models_checks_for_free():
    sched = Scheduler(num_slots=2, max_waiting=4, token_budget=64, speculative_tokens=8)
    sched.use_draft_model(8)
    sched.check_cost.freeze()
    r = decoding(sched, make_request("a", [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]), first=7)  # lookup drafts 8, 9, ...
    r.model_draft = ModelDraftState(prior=(9.9, 10.0), gain_prior=3.0)  # the draft model's drafts pay more
    r.drafter = NgramDrafter(8, prior=(0.1, 1.0), cost=sched.check_cost)  # prompt lookup's estimate is low
    out = sched.schedule()
    assert not out.verify and [d.request for d in out.draft_rows] == [r]
    before = r.drafter.acceptance_rate
    k = out.draft_rows[0].num_tokens
    sched.update_from_output(type(out)(None, (), (Verify(r, (8, 9, 10, 11)[:k], None, DRAFT_MODEL),)),
                             {r: [8, 9, 10, 11, 12][:k + 1]})
    assert r.drafter.acceptance_rate > before and r.drafter.num_drafted == 0  # learnt, though nothing was checked


def cpu_costs() -> CheckCost:
    """The check and draft costs measured on the 2-core CPU for the 1.5B and its 4-bit 0.5B draft (perf.spec_bound:
    a decode step 58 ms, a draft step 0.25 of it, a check of d tokens 1.09-2.52 steps)."""
    cost = CheckCost()
    cost.record_decode(0.058)
    cost.record_draft(first_s=0.016, num_rows=1, later_s=0.0145, num_later=1)
    for d, steps in {1: 1.086, 2: 1.306, 3: 1.474, 4: 1.701, 5: 1.875, 6: 2.123, 7: 2.305, 8: 2.515}.items():
        cost.record_check(d, 0.058 * steps)
    return cost


def test_a_row_keeps_drafting_through_unsure_misses_while_its_drafts_pay_on_the_whole():
    """Free text: where the draft model is unsure it stops after a token (--spec-draft-p-min) and that token often
    misses; where it is sure its draft is kept whole. Drafts go on at the row's limit, because what they gave, misses
    and all, beats plain steps (16 tokens in ~13 steps): the acceptance estimate alone stopped them after two misses."""
    cost = cpu_costs()
    state = ModelDraftState()
    checks = [(1, 0), (1, 0), (4, 4), (1, 0), (1, 1), (1, 0), (1, 0), (3, 3)] * 6  # (drafted, kept)
    planned = []
    for drafted, kept in checks:
        num, _ = state.plan(8, cost)
        planned.append(num)
        state.drafted_last = bool(num)
        if num:
            state.record(drafted, kept)
    assert planned == [8] * len(checks)
    assert 1.1 < state.realized_gain() < 1.4


def test_a_row_whose_drafts_never_pay_stops_after_a_few_checks_and_then_only_probes():
    cost = cpu_costs()
    state = ModelDraftState()
    planned = []
    for _ in range(60):
        num, _ = state.plan(8, cost)
        planned.append(num)
        state.drafted_last = bool(num)
        if num:
            state.record(1, 0)  # the draft model was unsure of its first token, and it missed
    first_off = planned.index(0)
    assert 3 <= first_off <= 16  # the prior's weight, spent by misses
    assert all(n in (0, PROBE_TOKENS) for n in planned[first_off:])
    assert sum(1 for n in planned[first_off:] if n) <= 3
