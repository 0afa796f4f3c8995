"""engine.embedding's pure parts: pooling of right-padded hidden states, normalization, batch planning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.embedding import EmbeddingConfig, EmbeddingEngine, l2_normalize, pool
from engine.types import InvalidRequestError


def _padded(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    s = max(len(r) for r in rows)
    hidden = np.full((len(rows), s, rows[0].shape[1]), 1e6, np.float32)  # padding: huge, must never count
    for b, r in enumerate(rows):
        hidden[b, : len(r)] = r
    return hidden, np.array([len(r) for r in rows])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_pooling_ignores_padding(lengths: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal((n, 5)).astype(np.float32) for n in lengths]
    hidden, lens = _padded(rows)
    want = {"mean": [r.mean(0) for r in rows], "cls": [r[0] for r in rows], "last": [r[-1] for r in rows],
            "max": [r.max(0) for r in rows]}
    for mode, expected in want.items():
        np.testing.assert_allclose(pool(hidden, lens, mode), np.stack(expected), rtol=1e-5, atol=1e-5)


def test_pool_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="pooling"):
        pool(np.zeros((1, 1, 2), np.float32), np.array([1]), "sum")


def test_l2_normalize_like_torch() -> None:
    v = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    np.testing.assert_allclose(l2_normalize(v), [[0.6, 0.8], [0.0, 0.0]])  # a zero vector stays zero


def test_config_names_the_bad_field() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        EmbeddingConfig(pooling="sum")
    assert exc.value.param == "pooling"
    with pytest.raises(InvalidRequestError) as exc:
        EmbeddingConfig(nice=20)
    assert exc.value.param == "nice"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=80), st.integers(1, 4096), st.integers(1, 64))
def test_batches_cover_every_item_within_budgets(lengths: list[int], budget: int, rows: int) -> None:
    engine = object.__new__(EmbeddingEngine)  # the planner only reads the config
    engine.config = EmbeddingConfig(max_batch_tokens=budget, max_batch_rows=rows)
    batches = engine._batches(lengths)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert lengths[b[0]] == longest  # longest first: the run's padded width
        assert len(b) <= rows and (len(b) == 1 or len(b) * longest <= budget)
