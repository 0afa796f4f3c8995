"""The batched logprobs of greedy rows equal the per-row log-softmax's, value for value (issue 22: the per-row
log-softmax cost more than a batch-64 model step on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import sampler, sampling_law
from engine.sampler import RequestSampler, batch_logprobs, sample_batch
from engine.types import SamplingParams


@pytest.mark.parametrize("rows,vocab", [(1, 50), (7, 1000), (40, 1 << 17)], ids=["one", "batch", "threaded"])
def test_batch_logprobs_equal_each_rows_log_softmax(rows, vocab, monkeypatch):
    monkeypatch.setattr(sampler.os, "cpu_count", lambda: 8)  # NOTE(test): the threaded split runs on 2 cores too
    monkeypatch.setattr(sampler, "_pool", None)
    rng = np.random.default_rng(rows)
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    logits[0, :3] = -np.inf  # excluded tokens (a mask) are never listed
    tokens = rng.integers(3, vocab, rows)
    top_n = [i % 4 for i in range(rows)]
    got = batch_logprobs(logits, tokens, top_n)
    assert (sampler._pool is not None) == (rows * vocab >= sampler._THREADED_LOGITS)
    for i in range(rows):
        want = RequestSampler(SamplingParams(logprobs=True, top_logprobs=top_n[i]), [], vocab).logprob_of(
            logits[i], int(tokens[i]))
        assert got[i] == want


def test_greedy_batch_with_logprobs_matches_each_rows_sampler_masks_included():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 300)).astype(np.float32)
    bitmask = np.full((5, 10), -1, dtype=np.int32)
    bitmask[2, 0] = 0  # row 2 may not use tokens 0-31
    logits[2, 5] = 50.0  # its raw argmax is forbidden
    params = [SamplingParams(temperature=0.0, logprobs=i % 2 == 0, top_logprobs=2 if i % 2 == 0 else 0)
              for i in range(5)]

    def fresh():
        return [RequestSampler(p, [], 300) for p in params]

    per_row = [s.sample(sampling_law.apply_token_bitmask(logits[i], bitmask[i]) if i == 2 else logits[i])
               for i, s in enumerate(fresh())]
    got = sample_batch(logits, fresh(), bitmask, [2])
    assert [r.token_id for r in got] == [r.token_id for r in per_row]
    assert [r.logprob for r in got] == [r.logprob for r in per_row]
    assert got[2].token_id != 5 and got[1].logprob is None


def test_a_device_row_summary_gives_the_same_greedy_tokens_and_logprobs_masks_included():
    """``sample_batch(summary=...)``: the rows' argmax and log-normalizer as a device computes them
    (engine.graph_capture.add_row_summary) stand in for the pass over the logits; a masked row that wants logprobs
    makes the batch take the pass (the summary is of the unmasked rows)."""
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((4, 500)) * 3).astype(np.float32)
    wide = logits.astype(np.float64)
    summary = (wide.argmax(axis=-1), (wide.max(axis=-1) + np.log(np.exp(
        wide - wide.max(axis=-1, keepdims=True)).sum(axis=-1))).astype(np.float32))
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=i) for i in range(4)]

    def fresh():
        return [RequestSampler(p, [], 500) for p in params]

    host, device = sample_batch(logits, fresh()), sample_batch(logits, fresh(), summary=summary)
    assert [r.token_id for r in device] == [r.token_id for r in host]
    for d, h in zip(device, host):
        assert abs(d.logprob.logprob - h.logprob.logprob) < 1e-5
        assert [t for t, _ in d.logprob.top] == [t for t, _ in h.logprob.top]
    # a summary the batch must not trust once a mask changes a row it reports logprobs for
    bitmask = np.full((4, 16), -1, dtype=np.int32)
    bitmask[1, summary[0][1] // 32] &= ~np.int32(1 << (int(summary[0][1]) % 32))  # row 1's argmax is forbidden
    masked = sample_batch(logits, fresh(), bitmask, [1], summary=summary)
    plain = sample_batch(logits, fresh(), bitmask, [1])
    assert masked[1].token_id != summary[0][1]
    assert [r.token_id for r in masked] == [r.token_id for r in plain]
    assert [r.logprob for r in masked] == [r.logprob for r in plain]
