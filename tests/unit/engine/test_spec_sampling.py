"""Speculative sampling with a draft model's q (engine.spec_decode.rejection through RequestSampler.verify): the
tokens follow the target's law, checked by Pearson's chi-square on next-token histograms (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.sampler import RequestSampler
from engine.spec_decode import rejection
from engine.types import SamplingParams
from tests.chi_square import chi_square_p_value

VOCAB = 8
NUM_SAMPLES = 20_000  # a 2% shift of mass between two tokens gives a statistic of ~80 here (p ~ 1e-14)


def _rows(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Target logits [3, V] and a draft's, deliberately unlike them (so rejections and residual draws are common)."""
    rng = np.random.default_rng(seed)
    target = rng.normal(scale=1.5, size=(3, VOCAB)).astype(np.float32)
    draft = (target[:, ::-1] + rng.normal(scale=0.5, size=(3, VOCAB))).astype(np.float32)
    return target, draft


def _histograms(params: SamplingParams, num_draft: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list]:
    """Counts of the first and second emitted tokens over NUM_SAMPLES checks, and the target's law of rows 0 and 1."""
    target, draft_logits = _rows(seed)
    sampler = RequestSampler(params, [0], VOCAB, np.random.default_rng(seed + 1))
    law = [rejection.probabilities(sampler.process(row)) for row in target]
    q = np.stack([rejection.probabilities(sampler.process(row)) for row in draft_logits])  # [3, V]
    first, second = np.zeros(VOCAB), np.zeros(VOCAB)
    rng = np.random.default_rng(seed + 2)
    for _ in range(NUM_SAMPLES):
        draft = [rejection.draw(q[j], rng.random()) for j in range(num_draft)]  # what the draft model draws
        tokens = [r.token_id for r in sampler.verify(target, draft, q[:num_draft])]
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second, law


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.8),
                                    SamplingParams(temperature=0.9, top_k=4)], ids=["temperature", "top_p", "top_k"])
def test_speculative_sampling_keeps_the_targets_next_token_distribution(params):
    first, second, law = _histograms(params, num_draft=2)
    for observed, p in ((first, law[0]), (second, law[1])):
        stat, p_value, df = chi_square_p_value(list(observed), list(observed.sum() * p))
        assert p_value > 1e-4, (stat, df, observed, observed.sum() * p)
    # the test can see a 2% shift: the same histogram against the law with 2% of the mass moved between two tokens
    shifted = law[0].copy()
    a, b = np.argsort(-shifted)[:2]
    shifted[a] -= 0.02
    shifted[b] += 0.02
    _, p_shifted, _ = chi_square_p_value(list(first), list(first.sum() * shifted))
    assert p_shifted < 1e-6


def test_the_chi_square_test_fails_when_the_residual_step_is_broken(monkeypatch):
    """A rejected position drawing from p instead of the normalised residual max(0, p - q) (the classic bug) skews
    the histogram towards what the draft over-proposes less: the same test must catch it."""
    monkeypatch.setattr(rejection, "residual", lambda p, q: p)
    first, _, law = _histograms(SamplingParams(temperature=0.7), num_draft=2)
    _, p_value, _ = chi_square_p_value(list(first), list(first.sum() * law[0]))
    assert p_value < 1e-6


def test_greedy_requests_ignore_q_and_keep_the_argmax_prefix():
    target, draft_logits = _rows(3)
    sampler = RequestSampler(SamplingParams(temperature=0.0), [0], VOCAB)
    best = target.argmax(axis=-1)
    q = np.full((2, VOCAB), 1.0 / VOCAB)
    assert [r.token_id for r in sampler.verify(target, [int(best[0]), int(best[1])], q)] == best.tolist()
    wrong = (int(best[0]) + 1) % VOCAB
    assert [r.token_id for r in sampler.verify(target, [wrong, 0], q)] == [int(best[0])]


def test_rejection_pieces_on_exact_vectors():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.25, 0.5, 0.25, 0.0])
    assert rejection.accept(p[0], q[0], 0.999)  # p > q: always kept
    assert rejection.accept(p[1], q[1], 0.59) and not rejection.accept(p[1], q[1], 0.6)  # kept with p/q = 0.6
    assert rejection.residual(p, q).tolist() == [1.0, 0.0, 0.0, 0.0]  # only token 0 has p > q
    assert [rejection.draw(p, u) for u in (0.0, 0.49, 0.5, 0.79, 0.8, 0.9999)] == [0, 0, 1, 1, 2, 2]
