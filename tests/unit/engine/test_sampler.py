"""Sampler: exact small cases, hypothesis properties, per-request seeds, the greedy fast path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from engine.sampler import RequestSampler, sample_batch, sample_from
from engine.sampling_law import (
    apply_logit_bias, apply_min_p, apply_penalties, apply_temperature, apply_top_k, apply_top_p, log_softmax,
    top_logprobs,
)
from engine.types import SamplingParams

finite = st.floats(-30, 30, allow_nan=False, width=32)
rows = arrays(np.float32, st.integers(2, 300), elements=finite)


def test_top_k_exact():
    logits = np.array([1.0, 5.0, 3.0, 4.0, 2.0], dtype=np.float32)
    out = apply_top_k(logits, 2)
    assert out.tolist() == [-np.inf, 5.0, -np.inf, 4.0, -np.inf]


def test_top_p_exact_keeps_the_token_that_crosses_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    kept = np.isfinite(apply_top_p(logits, 0.7))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7, then 0.3 crosses it
    kept = np.isfinite(apply_top_p(logits, 0.5))
    assert kept.tolist() == [True, False, False, False]


def test_top_p_beyond_the_probe_falls_back_to_a_full_sort():
    logits = np.zeros(1000, dtype=np.float32)  # uniform: the nucleus of 0.5 is 500 tokens
    assert np.isfinite(apply_top_p(logits, 0.5)).sum() == 500


def test_min_p_exact():
    probs = np.array([0.6, 0.3, 0.07, 0.03])
    kept = np.isfinite(apply_min_p(np.log(probs).astype(np.float32), 0.1))
    assert kept.tolist() == [True, True, True, False]  # threshold 0.06


def test_penalties_exact():
    logits = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    counts = np.array([2, 1, 0, 0])
    seen = np.array([True, True, True, False])
    out = apply_penalties(logits, counts, seen, presence=0.5, frequency=0.25, repetition=2.0)
    np.testing.assert_allclose(out, [2.0 / 2 - 0.5 - 0.5, -2.0 * 2 - 0.25 - 0.5, 0.5, 0.5])


def test_logit_bias_exact():
    out = apply_logit_bias(np.zeros(4, np.float32), np.array([1, 3]), np.array([5.0, -100.0]))
    assert out.tolist() == [0.0, 5.0, 0.0, -100.0]


def test_log_softmax_and_top_logprobs():
    logits = np.array([0.0, np.log(3.0)], dtype=np.float32)
    lp = log_softmax(logits)
    np.testing.assert_allclose(np.exp(lp), [0.25, 0.75], rtol=1e-6)
    top = top_logprobs(lp, 2)
    assert [t for t, _ in top] == [1, 0]


@settings(max_examples=100, deadline=None)
@given(rows, st.integers(1, 20))
def test_top_k_keeps_at_most_k_finite_values_ties_aside(logits, k):
    out = apply_top_k(logits, k)
    kept = np.isfinite(out)
    if k < len(logits):
        kth = np.sort(logits)[-k]
        assert kept.sum() == (logits >= kth).sum()  # ties at the k-th value are all kept
        assert kept.sum() >= k
        assert (logits[~kept] < kth).all()
    np.testing.assert_array_equal(out[kept], logits[kept])


@settings(max_examples=100, deadline=None)
@given(rows, st.floats(0.01, 1.0), st.integers(1, 5))
def test_top_p_keeps_the_mass_and_min_tokens(logits, p, min_keep):
    out = apply_top_p(logits, p, min_tokens_to_keep=min_keep)
    kept = np.isfinite(out)
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    assert kept.sum() >= min(min_keep, len(logits))
    assert probs[kept].sum() >= p - 1e-6
    # every kept token is at least as likely as every dropped one
    if (~kept).any():
        assert probs[kept].min() >= probs[~kept].max()


@settings(max_examples=100, deadline=None)
@given(rows, st.floats(0.0, 1.0), st.integers(1, 5))
def test_min_p_keeps_the_top_token_and_min_tokens(logits, p, min_keep):
    out = apply_min_p(logits, p, min_tokens_to_keep=min_keep)
    assert np.isfinite(out[np.argmax(logits)])
    assert np.isfinite(out).sum() >= min(min_keep, len(logits))


@settings(max_examples=60, deadline=None)
@given(rows, st.integers(0, 10), st.floats(0.05, 1.0), st.floats(0.0, 0.5), st.floats(0.1, 2.0))
def test_inputs_are_never_changed(logits, k, p, min_p, temperature):
    before = logits.copy()
    counts = np.zeros(len(logits), np.int64)
    counts[0] = 3
    apply_top_k(logits, k)
    apply_top_p(logits, p)
    apply_min_p(logits, min_p)
    apply_temperature(logits, temperature)
    apply_penalties(logits, counts, counts > 0, presence=1.0, frequency=1.0, repetition=1.5)
    apply_logit_bias(logits, np.array([0]), np.array([3.0]))
    params = SamplingParams(temperature=temperature, top_k=k, top_p=p, min_p=min_p, presence_penalty=1.0,
                            repetition_penalty=1.3, logit_bias=((0, 2.0),), seed=1, logprobs=True,
                            top_logprobs=3)
    RequestSampler(params, [0, 1], len(logits)).sample(logits)
    np.testing.assert_array_equal(logits, before)


@settings(max_examples=60, deadline=None)
@given(rows, st.integers(0, 2**31), st.data())
def test_temperature_to_zero_equals_argmax(logits, seed, data):
    # the greedy sampler is exactly np.argmax (first index on ties)
    greedy = RequestSampler(SamplingParams(temperature=0.0), [], len(logits))
    assert greedy.sample(logits).token_id == int(np.argmax(logits))
    # sampling at a temperature near 0 picks the top token once it leads by a margin
    best = data.draw(st.integers(0, len(logits) - 1))
    lead = logits.copy()
    lead[best] = logits.max() + 0.5
    rng = np.random.default_rng(seed)
    assert sample_from(apply_temperature(lead, 1e-3), rng) == best


def test_sample_from_never_picks_excluded_tokens():
    logits = np.full(50, -np.inf, dtype=np.float32)
    logits[[3, 17]] = [0.0, 0.0]
    rng = np.random.default_rng(0)
    picks = {sample_from(logits, rng) for _ in range(200)}
    assert picks == {3, 17}


def test_sample_from_follows_the_distribution():
    probs = np.array([0.1, 0.2, 0.7])
    rng = np.random.default_rng(0)
    draws = np.array([sample_from(np.log(probs).astype(np.float32), rng) for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 4000, probs, atol=0.03)


def test_same_seed_same_tokens_whatever_the_batch():
    rng = np.random.default_rng(123)
    steps = rng.normal(size=(12, 4, 100)).astype(np.float32)  # 12 steps, 4 rows
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)

    def run(row, companions):
        mine = RequestSampler(params, [1, 2], 100)
        others = [RequestSampler(p, [1], 100) for p in companions]
        out = []
        for logits in steps:
            batch = [mine] + others
            out.append(sample_batch(logits[row:row + len(batch)], batch)[0].token_id)
        return out

    alone = run(0, [])
    beside = run(0, [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
                     SamplingParams(temperature=0.5, seed=7)])
    assert alone == beside
    assert len(set(alone)) > 1  # it really sampled


def test_greedy_fast_path_is_one_argmax_and_matches_per_row():
    logits = np.random.default_rng(0).normal(size=(8, 1000)).astype(np.float32)
    samplers = [RequestSampler(SamplingParams(temperature=0.0), [], 1000) for _ in range(8)]
    fast = [r.token_id for r in sample_batch(logits, samplers)]
    assert fast == np.argmax(logits, axis=-1).tolist()


def test_repetition_penalty_changes_greedy_choice_and_records_tokens():
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    s = RequestSampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], 3)
    assert sample_batch(logits[None], [s])[0].token_id == 1  # token 0 was in the prompt
    assert s.output_counts.tolist() == [0, 1, 0]


def test_logprobs_are_raw_model_logprobs():
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    s = RequestSampler(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), [], 3)
    result = sample_batch(logits[None], [s])[0]
    assert result.token_id == 2
    assert result.logprob.logprob == pytest.approx(float(log_softmax(logits)[2]), abs=1e-6)
    assert [t for t, _ in result.logprob.top] == [2, 1]


def test_logit_bias_out_of_vocab_is_ignored():
    s = RequestSampler(SamplingParams(temperature=0.0, logit_bias=((99, 100.0), (1, 100.0))), [], 3)
    assert s.sample(np.array([5.0, 0.0, 0.0], np.float32)).token_id == 1


@pytest.mark.parametrize("penalty", [1e-46, 0.0, 0.009, 2.5])
def test_repetition_penalty_outside_its_range_is_refused_by_name(penalty: float) -> None:
    from engine.types import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"repetition_penalty must be in \[0.01, 2\]") as err:
        SamplingParams(repetition_penalty=penalty)
    assert err.value.param == "repetition_penalty"
