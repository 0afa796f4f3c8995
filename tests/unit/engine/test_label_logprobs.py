"""Label log-probabilities (decisions, rerank, score): exact against a float64 log-softmax, carried by sample_batch
for label rows only, and they keep the logits on the host (needs_logits)."""

from __future__ import annotations

import numpy as np

from engine.sampler import RequestSampler, label_logprobs, needs_logits, sample_batch
from engine.types import SamplingParams


def _reference(row: np.ndarray, ids: list[int]) -> list[float]:
    x = row.astype(np.float64)
    return [float(x[i] - np.log(np.exp(x - x.max()).sum()) - x.max()) for i in ids]


def test_label_logprobs_match_log_softmax() -> None:
    rng = np.random.default_rng(0)
    row = (rng.standard_normal(1000) * 5).astype(np.float32)
    got = label_logprobs(row, 7, np.array([3, 999, 0]))
    assert [t for t, _ in got.top] == [3, 999, 0]
    np.testing.assert_allclose([lp for _, lp in got.top], _reference(row, [3, 999, 0]), rtol=0, atol=1e-12)
    assert got.token_id == 7 and abs(got.logprob - _reference(row, [7])[0]) < 1e-12


def test_sample_batch_carries_labels_only_where_asked() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    before = logits.copy()
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    labelled = SamplingParams(max_tokens=1, temperature=0.0, label_token_ids=(5, 6))
    samplers = [RequestSampler(p, [1, 2], 50) for p in (plain, labelled, labelled)]
    assert needs_logits(samplers) and not needs_logits(samplers[:1])
    results = sample_batch(logits, samplers)
    assert results[0].logprob is None
    for i in (1, 2):
        assert results[i].token_id == int(np.argmax(logits[i]))
        np.testing.assert_allclose([lp for _, lp in results[i].logprob.top], _reference(logits[i], [5, 6]), atol=1e-12)
    np.testing.assert_array_equal(logits, before)  # the input is not changed


def test_labels_are_read_from_the_raw_distribution() -> None:
    """Penalties, bias and temperature shape sampling, never the labels' log-probabilities."""
    logits = np.linspace(-2, 2, 20, dtype=np.float32)[None]
    params = SamplingParams(max_tokens=1, temperature=0.7, logit_bias=((3, 50.0),), repetition_penalty=1.5,
                            label_token_ids=(3, 19))
    result = sample_batch(logits, [RequestSampler(params, [3, 19], 20, np.random.default_rng(0))])[0]
    np.testing.assert_allclose([lp for _, lp in result.logprob.top], _reference(logits[0], [3, 19]), atol=1e-12)
