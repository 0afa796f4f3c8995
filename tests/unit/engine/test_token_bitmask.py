"""The sampler's side of constrained decoding: applying llguidance-layout token bitmasks (pure numpy)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.sampler import RequestSampler, sample_batch
from engine.sampling_law import apply_token_bitmask, log_softmax, token_allowed
from engine.types import SamplingParams


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool ``[..., vocab]`` -> int32 ``[..., ceil(vocab / 32)]``, written bit by bit (the reference layout:
    bit j of word i allows token 32 * i + j)."""
    vocab = allowed.shape[-1]
    words = np.zeros(allowed.shape[:-1] + ((vocab + 31) // 32,), dtype=np.uint32)
    for index in np.ndindex(allowed.shape[:-1]):
        for token in np.flatnonzero(allowed[index]):
            words[index + (token // 32,)] |= np.uint32(1) << np.uint32(token % 32)
    return words.view(np.int32)


def test_apply_token_bitmask_exact():
    logits = np.arange(40, dtype=np.float32)  # vocab 40: two words, the last 24 bits unused
    bitmask = np.array([(1 << 3) | (1 << 31), (1 << 0) | (1 << 7) | (1 << 30)], dtype=np.uint32).view(np.int32)
    out = apply_token_bitmask(logits, bitmask)
    assert np.flatnonzero(np.isfinite(out)).tolist() == [3, 31, 32, 39]  # bit 30 of word 1 is token 62: cut
    assert out[np.isfinite(out)].tolist() == [3.0, 31.0, 32.0, 39.0]
    assert (out[~np.isfinite(out)] == -np.inf).all()
    assert out.dtype == np.float32 and out.shape == logits.shape


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3), st.integers(1, 200), st.integers(0, 2**32 - 1))
def test_apply_token_bitmask_matches_the_bitwise_reference(num_rows, vocab, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32)
    allowed = rng.random((num_rows, vocab)) < 0.3
    before = logits.copy()
    out = apply_token_bitmask(logits, pack(allowed))
    np.testing.assert_array_equal(np.isfinite(out), allowed)
    np.testing.assert_array_equal(out[allowed], logits[allowed])
    np.testing.assert_array_equal(logits, before)  # the input is never changed


def test_all_ones_mask_changes_nothing():
    logits = np.random.default_rng(0).normal(size=(2, 100)).astype(np.float32)
    np.testing.assert_array_equal(apply_token_bitmask(logits, np.full((2, 4), -1, np.int32)), logits)


def _batch(n, vocab, seed=0):
    return np.random.default_rng(seed).normal(size=(n, vocab)).astype(np.float32)


def test_greedy_batch_masks_only_the_masked_rows():
    logits = _batch(4, 300)
    allowed = np.zeros((4, 300), bool)
    allowed[1, [5, 250]] = True
    allowed[3, [7]] = True
    samplers = [RequestSampler(SamplingParams(temperature=0.0), [], 300) for _ in range(4)]
    # rows 0 and 2 have garbage in their bitmask rows: unmasked rows must never read them
    bitmask = pack(allowed)
    tokens = [r.token_id for r in sample_batch(logits, samplers, bitmask, masked_rows=[1, 3])]
    assert tokens[0] == int(np.argmax(logits[0])) and tokens[2] == int(np.argmax(logits[2]))
    assert tokens[1] == (5 if logits[1, 5] > logits[1, 250] else 250)
    assert tokens[3] == 7


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(2, 300), st.floats(0.0, 1.0), st.integers(0, 2**32 - 1))
def test_greedy_shortcut_equals_masking_every_row(num_rows, vocab, density, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32)
    logits[:, rng.integers(vocab)] = logits.max() + 1  # often the argmax is allowed, sometimes not
    allowed = rng.random((num_rows, vocab)) < density
    allowed[np.arange(num_rows), rng.integers(vocab, size=num_rows)] = True
    bitmask = pack(allowed)
    assert all(token_allowed(bitmask[r], t) == allowed[r, t] for r in range(num_rows) for t in range(vocab))
    masked = rng.permutation(num_rows)[:max(1, num_rows // 2)].tolist()
    samplers = [RequestSampler(SamplingParams(temperature=0.0), [], vocab) for _ in range(num_rows)]
    tokens = [r.token_id for r in sample_batch(logits, samplers, bitmask, masked)]
    for r in range(num_rows):
        row = apply_token_bitmask(logits[r], bitmask[r]) if r in masked else logits[r]
        assert tokens[r] == int(np.argmax(row))


def test_no_transform_brings_back_a_forbidden_token():
    vocab = 64
    logits = np.zeros((1, vocab), np.float32)
    logits[0, 10] = 5.0  # the model's favourite, forbidden below
    allowed = np.zeros((1, vocab), bool)
    allowed[0, [20, 21]] = True
    params = SamplingParams(temperature=0.0, logit_bias=((10, 100.0),), repetition_penalty=0.5,
                            presence_penalty=-2.0)
    sampler = RequestSampler(params, [10], vocab)
    assert sample_batch(logits, [sampler], pack(allowed), [0])[0].token_id in (20, 21)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.3, 2.0), st.floats(0.2, 1.0), st.integers(0, 20))
# a top-k of 2 past a mask that leaves 6 tokens: a zero first floor took the padding past the vocabulary (IndexError)
@example(3541594680, 0.41352434054272325, 0.4322695514575253, 2)
def test_sampling_only_ever_picks_allowed_tokens(seed, temperature, top_p, top_k):
    rng = np.random.default_rng(seed)
    vocab = 150
    allowed = rng.random((1, vocab)) < 0.05
    allowed[0, rng.integers(vocab)] = True  # at least one
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed % 1000,
                            frequency_penalty=0.5, min_p=0.05)
    sampler = RequestSampler(params, [0, 1], vocab)
    bitmask = pack(allowed)
    for _ in range(10):
        token = sample_batch(_batch(1, vocab, int(rng.integers(1 << 30))), [sampler], bitmask, [0])[0].token_id
        assert allowed[0, token]


def test_logprobs_are_after_the_mask_and_list_only_allowed_tokens():
    logits = np.array([[3.0, 2.0, 1.0, 0.0]], np.float32)
    allowed = np.array([[False, True, False, True]])
    sampler = RequestSampler(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4), [], 4)
    result = sample_batch(logits, [sampler], pack(allowed), [0])[0]
    assert result.token_id == 1
    expected = log_softmax(np.array([2.0, 0.0], np.float32))  # renormalized over the allowed tokens
    assert result.logprob.logprob == pytest.approx(float(expected[0]), abs=1e-6)
    assert [t for t, _ in result.logprob.top] == [1, 3]  # forbidden tokens are never listed
    assert all(np.isfinite(lp) for _, lp in result.logprob.top)
