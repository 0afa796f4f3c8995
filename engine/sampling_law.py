"""The sampling law: pure numpy transforms of logits, each the reference for what a request's sampler does (the
vectorized draw of ``engine.sampling_fast`` must pick what these, then a softmax, give).

Every ``apply_*`` function returns a new array and never changes its input; no onnxruntime import.
Shapes: ``logits`` is float32 ``[..., vocab]`` (one row per request); filtered-out tokens are ``-inf``.
"""

from __future__ import annotations

import numpy as np

# NOTE(engine): top-p first looks at the best _TOP_P_PROBE tokens; if they already hold p of the mass
# the nucleus is among them (they are the most likely ones), so the full-vocab sort is skipped. Exact.
_TOP_P_PROBE = 64


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Constrained decoding: tokens whose bit is 0 become ``-inf``.

    Args:
        logits: float32 ``[..., vocab]``.
        bitmask: int32 ``[..., words]`` with ``words * 32 >= vocab`` (llguidance's layout: bit ``j`` of word
            ``i`` allows token ``32 * i + j``); bits past ``vocab`` are ignored.
    Returns:
        New logits, same shape and dtype.
    """
    # NOTE(engine): viewing int32 words as bytes is little-endian on every platform onnxruntime ships for, so
    # byte k // 8, bit k % 8 (bitorder="little") is token k; this is what llguidance's own numpy kernel does.
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, count=logits.shape[-1], bitorder="little")
    return np.where(allowed.view(np.bool_), logits, np.array(-np.inf, dtype=logits.dtype))


def token_allowed(bitmask_row: np.ndarray, token_id: int) -> bool:
    """Whether one int32 bitmask row (see apply_token_bitmask) allows ``token_id``."""
    return bool((int(bitmask_row[token_id >> 5]) >> (token_id & 31)) & 1)


def apply_logit_bias(logits: np.ndarray, token_ids: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Add ``bias[i]`` to ``logits[..., token_ids[i]]`` (OpenAI's logit_bias, values in [-100, 100])."""
    out = logits.copy()
    np.add.at(out, (..., token_ids), bias.astype(logits.dtype))
    return out


def apply_penalties(logits: np.ndarray, output_counts: np.ndarray, seen_mask: np.ndarray, *,
                    presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> np.ndarray:
    """OpenAI presence/frequency penalties and the CTRL repetition penalty.

    Args:
        logits: float32 ``[..., vocab]``.
        output_counts: int ``[..., vocab]``, how often each token was generated so far (presence and
            frequency look at the output only, as OpenAI does).
        seen_mask: bool ``[..., vocab]``, tokens in the prompt or the output (repetition looks at both,
            as transformers does): positive logits are divided by ``repetition``, negative multiplied.
    """
    out = logits
    if repetition != 1.0:
        out = np.where(seen_mask, np.where(out > 0, out / repetition, out * repetition), out)
    if presence != 0.0 or frequency != 0.0:
        out = out - (frequency * output_counts + presence * (output_counts > 0)).astype(logits.dtype)
    return out if out is not logits else logits.copy()


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Divide by ``temperature`` (> 0; 0 means greedy and is handled by the caller with argmax)."""
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0 here (0 is greedy), got {temperature}")
    return logits / np.float32(temperature)


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the ``k`` largest logits per row (ties at the k-th value are all kept); 0 disables."""
    vocab = logits.shape[-1]
    if k <= 0 or k >= vocab:
        return logits.copy()
    kth = np.partition(logits, -k, axis=-1)[..., -k, None]
    return np.where(logits < kth, -np.inf, logits).astype(logits.dtype, copy=False)


def apply_top_p(logits: np.ndarray, p: float, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Nucleus filtering: keep the most likely tokens whose probabilities first sum to at least ``p``.

    A token is kept when the mass of the tokens ranked above it is below ``p``; at least
    ``min_tokens_to_keep`` tokens always survive. Typical values 0.9-0.95; 1.0 disables.
    """
    if p >= 1.0:
        return logits.copy()
    rows = logits.reshape(-1, logits.shape[-1])  # (N, V)
    out = np.full_like(rows, -np.inf)
    for i, row in enumerate(rows):
        keep = _nucleus(row, p, min_tokens_to_keep)
        out[i, keep] = row[keep]
    return out.reshape(logits.shape)


def apply_min_p(logits: np.ndarray, p: float, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Drop tokens whose probability is below ``p`` times the top token's; 0 disables."""
    if p <= 0.0:
        return logits.copy()
    top = logits.max(axis=-1, keepdims=True)
    # prob_i / prob_max = exp(logit_i - logit_max) < p  <=>  logit_i < logit_max + log(p)
    out = np.where(logits < top + np.log(p), -np.inf, logits).astype(logits.dtype, copy=False)
    keep = min(min_tokens_to_keep, logits.shape[-1])
    if keep > 1:
        kth = np.partition(logits, -keep, axis=-1)[..., -keep, None]
        out = np.where(logits >= kth, logits, out)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-probabilities over the last axis."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top_logprobs(logprobs: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely (token_id, logprob) pairs of a 1-D row, most likely first.

    Tokens a mask excluded (``-inf``) are never listed, so a constrained row may give fewer than ``n``.
    """
    n = min(n, logprobs.shape[-1])
    if n <= 0:
        return ()
    idx = np.argpartition(logprobs, -n)[-n:]
    idx = idx[np.argsort(-logprobs[idx], kind="stable")]
    return tuple((int(i), float(logprobs[i])) for i in idx if logprobs[i] > -np.inf)


def _nucleus(row: np.ndarray, p: float, min_keep: int) -> np.ndarray:
    """Indices of the nucleus of one row of logits (see apply_top_p)."""
    probs = np.exp(row.astype(np.float64) - row.max())
    probs /= probs.sum()
    vocab = len(row)
    probe = min(max(_TOP_P_PROBE, min_keep), vocab)
    if probe < vocab:
        # every token tied with the probe's last one too, in id order: ties rank by id, as in a full sort
        cand = np.flatnonzero(probs >= probs[np.argpartition(probs, -probe)[-probe:]].min())
        cand = cand[np.argsort(-probs[cand], kind="stable")]
        if probs[cand].sum() < p:
            cand = np.argsort(-probs, kind="stable")
    else:
        cand = np.argsort(-probs, kind="stable")
    cum_before = np.cumsum(probs[cand]) - probs[cand]  # mass ranked strictly above each candidate
    num_keep = max(int(np.count_nonzero(cum_before < p)), min_keep)
    return cand[:num_keep]
