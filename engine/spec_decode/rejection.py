"""Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft token t with min(1, p(t) / q(t)),
else draw from the normalised residual max(0, p - q); the tokens it yields follow the target's p exactly, whatever q
the draft drew from. Pure numpy, no onnxruntime import.

Shapes: ``p`` and ``q`` are float64 probability rows ``[vocab]`` (zeros where a filter removed a token).
"""

from __future__ import annotations

import numpy as np


def probabilities(processed: np.ndarray) -> np.ndarray:
    """float64 ``softmax`` of one row of processed logits (``-inf`` = removed): the law a sampler draws from."""
    x = processed.astype(np.float64)
    top = x.max()
    w = np.exp(x - top)
    return w / w.sum()


def accept(p_token: float, q_token: float, u: float) -> bool:
    """Keep a draft token whose target probability is ``p_token`` and draft probability ``q_token`` (> 0: the draft
    drew it) with probability min(1, p / q), given a uniform ``u`` in [0, 1)."""
    return u * q_token < p_token


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The distribution a rejected position draws from: ``max(0, p - q)`` normalised (``p`` itself where that is all
    zeros, which only rounding can make: a rejection means p(t) < q(t) somewhere, so p - q > 0 elsewhere)."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p


def draw(probs: np.ndarray, u: float) -> int:
    """The token where the CDF of ``probs`` (float64 ``[vocab]``) in id order first passes ``u`` in [0, 1)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(probs) - 1))
