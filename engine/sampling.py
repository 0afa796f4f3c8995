"""Vectorized draws for a batch of rows: temperature, top-k, top-p and min-p for every row at once, and one
inverse-CDF draw per row from a uniform the caller gives. Pure numpy (no onnxruntime import).

The law is ``engine.sampler``'s reference transforms applied in its order (temperature, top-k, top-p over
the top-k survivors, min-p) followed by a draw from the softmax of what is left: ``draw_tokens`` picks the
token where that distribution's CDF, in token-id order, passes ``u``; only the route differs (float32
weights, block sums, candidates near the best token instead of sorts of the whole vocabulary).
"""

from __future__ import annotations

import numpy as np

# NOTE(engine): the draw sums exp(logits - max) in blocks of _BLOCK tokens, picks the block by a cumsum of the
# block sums, then the token by a cumsum inside that block: two short cumsums instead of a float64 cumsum over
# the whole vocabulary (~1.5 ms a row at 49k on the CI machine; this whole function is a few passes).
_BLOCK = 256
_CACHE_FLOATS = 1 << 18  # 1 MB of float32: what a row group may span (see draw_tokens)
# NOTE(engine): filters look at candidates first: tokens whose weight exp(y - max) is at least _CUTS[0] (within
# 9 nats of the best; tens to a few hundred on real rows at temperature 1, >= 97% of the mass), then
# _CUTS[1] (18 nats), then every finite token. A round is kept for a row only when its candidates provably hold
# the row's whole result (top-k: at least k candidates; top-p without top-k: at least p of the row's mass),
# so the result is exact, and a long sort happens only for the rare row that needs one.
_CUTS = (float(np.exp(-9.0)), float(np.exp(-18.0)), None)
_GROUP_ROWS = 64  # top-k: the padded row seen as 64 rows of G = width / 64 tokens (see _draw_filtered)
_LOWEST = np.float32(-np.finfo(np.float32).max)  # the last round's floor on y: every finite value
# NOTE(engine): a min-p-only row's candidates are the weights >= min_p * (1 - _MARGIN); the exact test on y
# (the reference's float64 ``y < max + log(min_p)``) then runs on them, so float32 rounding loses nothing.
_MARGIN = 1e-4


def draw_tokens(logits: np.ndarray, u: np.ndarray, *, temperature: np.ndarray | None = None,
                top_k: np.ndarray | None = None, top_p: np.ndarray | None = None,
                min_p: np.ndarray | None = None) -> np.ndarray:
    """One token per row from ``softmax(filter(logits / temperature))``.

    Args:
        logits: float32 ``[n, vocab]``; ``-inf`` = excluded (a grammar mask). Not changed.
        u: float64 ``[n]`` uniforms in [0, 1), one per row (the request's own rng draw).
        temperature: float ``[n]`` > 0 (None: 1 everywhere).
        top_k: int ``[n]``, 0 = off (None: off everywhere); ties at the k-th value are all kept.
        top_p: float ``[n]`` in (0, 1], 1 = off: the most likely tokens whose mass (over the top-k
            survivors) first reaches p.
        min_p: float ``[n]`` in [0, 1], 0 = off: tokens below min_p times the best token's probability go.
    Returns:
        int64 ``[n]`` token ids.
    """
    n, vocab = logits.shape
    y = logits
    scale = None
    if temperature is not None and np.any(temperature != 1.0):
        scale = np.asarray(temperature, dtype=np.float32)[:, None]
        y = np.empty_like(logits)  # logits / temperature, float32 as apply_temperature; filled group by group
    k = np.zeros(n, dtype=np.int64) if top_k is None else np.asarray(top_k, dtype=np.int64)
    k = np.where((k > 0) & (k < vocab), k, 0)
    # 1. weights = exp(y - top), zero past the vocab, and their block sums: (n, nb, B), (n, nb)
    num_blocks = -(-vocab // _BLOCK)
    num_groups = num_blocks * _BLOCK // _GROUP_ROWS
    maxima = np.empty((n, num_groups), dtype=np.float32) if np.any((k > 0) & (k <= num_groups)) else None
    weights = np.empty((n, num_blocks * _BLOCK), dtype=np.float32)
    weights[:, vocab:] = 0.0
    top = np.empty(n, dtype=np.float32)
    block_mass = np.empty((n, num_blocks), dtype=np.float32)
    ones = np.ones(_BLOCK, dtype=np.float32)
    # NOTE(engine): in groups of rows that fit in a core's cache (a 262k-wide row is 1 MB): the temperature, the
    # max, the exp and the block sums then read the group from cache, not memory (3x at 262k; 49k: 5 rows a group).
    step = max(1, _CACHE_FLOATS // vocab)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        if scale is not None:
            np.divide(logits[lo:hi], scale[lo:hi], out=y[lo:hi])
        top[lo:hi] = y[lo:hi].max(axis=-1)
        np.subtract(y[lo:hi], top[lo:hi, None], out=weights[lo:hi, :vocab])
        np.exp(weights[lo:hi, :vocab], out=weights[lo:hi, :vocab])  # -inf -> 0
        # NOTE(engine): a matrix-vector product sums the blocks (BLAS, ~1e-7 relative in float32): 5x faster
        # than numpy's sum over a short last axis, whose per-block overhead dominates at 256 elements.
        block_mass[lo:hi] = (weights[lo:hi].reshape(-1, _BLOCK) @ ones).reshape(hi - lo, num_blocks)
        if maxima is not None:  # top-k's group maxima (see _draw_filtered), while the group is in cache
            maxima[lo:hi] = weights[lo:hi].reshape(hi - lo, _GROUP_ROWS, num_groups).max(axis=1)
    blocks = weights.reshape(n, num_blocks, _BLOCK)
    block_mass = block_mass.astype(np.float64)
    # 2. the rows without filters draw over their whole row; the others over their kept candidates
    p = np.ones(n) if top_p is None else np.asarray(top_p, dtype=np.float64)
    mp = np.zeros(n) if min_p is None else np.asarray(min_p, dtype=np.float64)
    filtered = (k > 0) | (p < 1.0) | (mp > 0.0)
    tokens = np.empty(n, dtype=np.int64)
    dense = np.flatnonzero(~filtered)
    if len(dense):
        tokens[dense] = _draw_blocks(blocks[dense] if len(dense) < n else blocks,
                                     block_mass[dense], u[dense])
    if len(dense) < n:
        _draw_filtered(y, top, weights, block_mass.sum(axis=-1), maxima, u, k, p, mp, filtered, tokens)
    return tokens


def _draw_blocks(blocks: np.ndarray, block_mass: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws over whole rows: ``blocks`` float32 weights ``(r, nb, B)``, ``block_mass`` their sums."""
    r, num_blocks, size = blocks.shape
    block_cdf = np.cumsum(block_mass, axis=-1)  # (r, nb)
    target = u * block_cdf[:, -1]  # (r,)
    rows = np.arange(r)
    block = (block_cdf <= target[:, None]).sum(axis=-1)  # the first block whose cdf passes the target
    # NOTE(engine): u * total can round up to the total; the last block with mass holds the answer then.
    block = np.minimum(block, num_blocks - 1 - np.argmax(block_mass[:, ::-1] > 0, axis=-1))
    below = np.where(block > 0, block_cdf[rows, np.maximum(block - 1, 0)], 0.0)
    # NOTE(engine): the target's place inside its block, as a fraction of the block's mass, is laid on the
    # block's own float64 cumsum: no token gains what the float32 block sums lose to rounding.
    fraction = np.clip((target - below) / block_mass[rows, block], 0.0, 1.0)
    chosen = blocks[rows, block]  # (r, B)
    inner = np.cumsum(chosen, axis=-1, dtype=np.float64)
    offset = (inner <= (fraction * inner[:, -1])[:, None]).sum(axis=-1)
    last = size - 1 - np.argmax(chosen[:, ::-1] > 0, axis=-1)  # the last token with mass
    return block * size + np.minimum(offset, last)


def _draw_filtered(y: np.ndarray, top: np.ndarray, weights: np.ndarray, mass: np.ndarray, maxima: np.ndarray | None,
                   u: np.ndarray, k: np.ndarray, p: np.ndarray, mp: np.ndarray, filtered: np.ndarray,
                   tokens: np.ndarray) -> None:
    """The rows in ``filtered``: their kept tokens among candidates near the best token, then the draw
    (written into ``tokens``). ``mass``: each row's total weight; ``maxima``: the weights' strided group
    maxima ``(n, G)`` when a row has a top-k of at most G."""
    n, width = weights.shape
    need_sort = (k > 0) | (p < 1.0)
    # NOTE(engine): a top-k row's k-th best value is at least the k-th largest of the maxima of any k disjoint
    # groups of its tokens (those maxima are k distinct tokens), so the weights above that hold the top k:
    # usually k to 2k candidates, decided at once. The groups are strided (token i in group i % G), so their
    # maxima are one vectorized pass over _GROUP_ROWS rows of G tokens.
    num_groups = width // _GROUP_ROWS
    by_groups = (k > 0) & (k <= num_groups)
    group_floor = np.zeros(n, dtype=np.float32)
    if by_groups.any():
        assert maxima is not None
        ranked = -np.sort(-maxima[by_groups], axis=-1)  # (rows, G), largest first
        group_floor[by_groups] = ranked[np.arange(len(ranked)), k[by_groups] - 1]
    pending = filtered.copy()
    for cut in _CUTS:
        if cut is None:  # the last round: every finite token of the rows still pending
            candidates = (y >= _LOWEST) & pending[:, None]
        else:
            floor = np.where(need_sort, cut, mp * (1.0 - _MARGIN)).astype(np.float32)
            floor = np.where(by_groups, group_floor, floor)
            floor[~pending] = np.inf
            candidates = weights[:, :y.shape[1]] >= floor[:, None]
        done = _kept_and_drawn(candidates, y, top, weights, mass, u, k, p, mp, need_sort & pending,
                               cut is None, tokens)
        pending &= ~done
        if not pending.any():
            return


def _ranked(row: np.ndarray, col: np.ndarray, val: np.ndarray) -> np.ndarray:
    """The order of candidates by row, then value (best first), then token id: the reference's stable sort.

    NOTE(engine): one sort of int64 keys (row, value's order-preserving bits, token id) instead of a lexsort
    of three keys (50x faster at a few thousand candidates).
    """
    if row.size and (row[-1] >= 1 << 10 or col.max() >= 1 << 21):  # keys would not fit: the general route
        return np.lexsort((col, -val, row))
    bits = (val + np.float32(0.0)).view(np.int32).astype(np.int64)  # + 0.0: -0.0 ties with 0.0, as in the reference
    ordered = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + (1 << 31)  # increasing with val, in [0, 2**32)
    key = (row << 53) | (((1 << 32) - 1 - ordered) << 21) | col
    return np.argsort(key)  # keys are distinct: no tie for the sort to break


def _kept_and_drawn(candidates: np.ndarray, y: np.ndarray, top: np.ndarray, weights: np.ndarray,
                    mass: np.ndarray, u: np.ndarray, k: np.ndarray, p: np.ndarray, mp: np.ndarray,
                    need_sort: np.ndarray, last_round: bool, tokens: np.ndarray) -> np.ndarray:
    """One round of ``_draw_filtered`` over a boolean ``[n, vocab]`` candidate mask; writes the tokens of the
    rows it can decide and returns which rows those are."""
    n, vocab = y.shape
    flat = np.flatnonzero(candidates.ravel())  # row-major: by row, then token id
    row, col = np.divmod(flat, vocab)
    val = y[row, col]  # float32 candidate logits
    weight = weights[row, col].astype(np.float64)
    count = np.bincount(row, minlength=n)
    start = np.cumsum(count) - count
    decided = count > 0
    keep = np.ones(len(flat), dtype=bool)
    if need_sort[row].any():
        # 1. rank each row's candidates: best first, ties by token id
        order = _ranked(row, col, val)
        s_row, s_val, s_w = row[order], val[order], weight[order]
        # 2. top-k: the k-th best value; everything at least as good stays (ties included)
        has_k = k > 0
        enough = has_k & (count >= k)
        if not last_round:
            decided &= ~has_k | enough
        kth = np.full(n, -np.inf, dtype=np.float32)
        kth[enough] = s_val[start[enough] + k[enough] - 1]
        s_keep = s_val >= kth[s_row]
        # 3. top-p over the top-k survivors (or the whole row): kept while the mass ranked above is < p
        has_p = p < 1.0
        kept_w = np.where(s_keep, s_w, 0.0)
        csum = np.cumsum(kept_w)
        live = count > 0
        row_kept = np.zeros(n)
        row_kept[live] = np.add.reduceat(kept_w, start[live])
        total = np.where(has_k, row_kept, mass)
        first = np.minimum(start, len(order) - 1)
        before = csum - kept_w - (csum[first] - kept_w[first])[s_row]  # mass ranked above, within the row
        with np.errstate(invalid="ignore", divide="ignore"):
            s_keep &= ~has_p[s_row] | (before / total[s_row] < p[s_row])
            if not last_round:
                row_all = np.zeros(n)
                row_all[live] = np.add.reduceat(s_w, start[live])
                decided &= ~(has_p & ~has_k) | (row_all / mass >= p)
        keep[order] = s_keep
    # 4. min-p last: what lies below top + log(min_p) goes (a float64 threshold, as the reference's)
    with np.errstate(divide="ignore"):
        keep &= ~(mp[row] > 0.0) | ~(val < top[row] + np.log(np.where(mp > 0.0, mp, 1.0))[row])
    # 5. the draw among the kept candidates of the decided rows, in token-id order
    keep &= decided[row]
    rows = np.flatnonzero(decided)
    k_col, k_w = col[keep], weight[keep]
    cdf = np.cumsum(k_w)
    k_count = np.bincount(row[keep], minlength=n)[rows]
    k_end = np.cumsum(k_count)
    k_start = k_end - k_count
    below = np.where(k_start > 0, cdf[np.maximum(k_start - 1, 0)], 0.0)
    target = below + u[rows] * (cdf[k_end - 1] - below)
    pos = np.minimum(np.searchsorted(cdf, target, side="right"), k_end - 1)
    # NOTE(engine): u * mass can round up to the mass; the last kept token with mass is the answer then
    for i in np.flatnonzero(k_w[pos] == 0):
        pos[i] = k_start[i] + np.flatnonzero(k_w[k_start[i]:k_end[i]])[-1]
    tokens[rows] = k_col[pos]
    return decided
