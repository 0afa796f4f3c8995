"""The fast path of sampling: vectorized draws for a batch of rows: temperature, top-k, top-p and min-p for every
row at once, and one inverse-CDF draw per row from a uniform the caller gives. Pure numpy (no onnxruntime import).

The law is ``engine.sampling_law``'s reference transforms applied in ``engine.sampler.RequestSampler.process``'s
order (sparse edits such as logit_bias and the penalties, temperature, top-k, top-p over the top-k survivors, min-p)
followed by a draw from the softmax of what is left: ``draw_tokens`` picks the token where that distribution's CDF,
in token-id order, passes ``u``; only the route differs (float32 weights, block sums, candidates near the best token
instead of sorts of the whole vocabulary).
"""

from __future__ import annotations

import numpy as np

# NOTE(engine): the draw sums exp(logits - max) in blocks of _BLOCK tokens, picks the block by a cumsum of the
# block sums, then the token by a cumsum inside that block: two short cumsums instead of a float64 cumsum over
# the whole vocabulary (~1.5 ms a row at 49k on the CI machine; this whole function is a few passes). The same
# sums find the filters' candidates (see _FIRST_CUT): 64-token blocks read 2.5-4x fewer tokens there than
# 256-token ones, for the same cost of the sums.
_BLOCK = 64
# NOTE(engine): rows are processed in groups of at most this many logits (1 MB of float32): each group's
# tempered logits and weights stay in a core's cache (2 MB of L2 here) from the first pass to the candidates,
# in two buffers reused group after group instead of two [n, vocab] arrays, whose fresh pages cost more to
# fault in than the passes themselves (262k vocab, temperature 0.7: 1.36 ms a row before, see cpu.md).
# Groups of 2 MB were 2x slower at 262k.
_CACHE_FLOATS = 1 << 18
# NOTE(engine): filters look at candidates, the tokens whose weight exp(y - max) is at least a floor, found
# through the block sums (a block holds a token of weight >= f only if its sum is >= f: sums of non-negative
# floats never round below a term), and keep a floor only when its candidates provably hold the row's whole
# result, so the result is exact:
# - top-k (k at most G = vocab // 64): the k-th largest maximum of G strided groups, a value that k distinct
#   tokens reach, so the k best are among the k to ~2k candidates; decided at once;
# - min-p alone: min_p itself (less a margin): nothing below it stays;
# - top-p without top-k: 9 nats below the best (tens to a few hundred tokens on real rows, >= 93% of the
#   mass), kept when the candidates hold p of the mass; else 12.5 nats; else the highest floor f that the
#   block sums prove enough (what lies below f in block b weighs at most min(sum_b, B f)); else every token
#   with weight; past the first floor, only the candidates down to where p is held go on (_trimmed);
# - top-k beyond G: 9 nats, then 18, then every token with weight, kept once k candidates are in.
_FIRST_CUT = float(np.exp(-9.0))
_SECOND_CUT = float(np.exp(-18.0))
_TOP_P_CUT = float(np.exp(-12.5))
_TOP_P_FLOORS = np.exp(-np.arange(10.0, 41.0))  # top-p's proven floors, highest first (10 to 40 nats)
_GROUP_ROWS = 64  # top-k: the first 64 G tokens of a row seen as 64 rows of G = vocab // 64 tokens
_ANY_WEIGHT = np.finfo(np.float32).tiny  # the last floor: every token with weight (see _SUBNORMAL)
# NOTE(engine): a min-p row's floor is min_p * (1 - _MARGIN) (a top-k row's, its floor's weight less the
# margin); the exact tests on y (the reference's float64 ``y < max + log(min_p)``, the k-th value) then run on
# the candidates, so float32 rounding loses nothing.
_MARGIN = 1e-4
# NOTE(engine): exp of inputs in [-103.9, -87.3] gives subnormal floats, 13x slower to make and ~50x slower to
# sum (x86 microcode assists; real rows reach them at temperatures below ~0.5: 262k rows at temperature 0.3
# took 3.4 ms a row). A group where more than 1/32 of the finite values go below -87 nats (_deep) is clamped
# there before the exp (a masked -inf too), and every weight at the clamp's exp(-87) = 1.65e-38 is then set to
# exactly 0: those tokens had less than 1.7e-38 of the best token's weight, which no draw can tell from 0 (a
# float64 CDF cannot resolve it), and a masked token stays at 0. The clamp costs three passes (0.15 ms a row
# at 262k), more than a few subnormals do (a logit_bias of -100 on 10 tokens: 0.73 ms a row clamped, vs 0.5);
# a masked copy (np.copyto(where=)) costs 10x the clamp.
_SUBNORMAL = np.float32(-87.0)
_SUBNORMAL_WEIGHT = np.float32(1.7e-38)
_DIRECT_MAX = np.float32(80.0)  # the highest y whose exp(y) the weights may hold unshifted (see _weights),
_DIRECT_MIN = np.float32(-60.0)  # and the lowest best token's


def draw_tokens(logits: np.ndarray, u: np.ndarray, *, temperature: np.ndarray | None = None,
                top_k: np.ndarray | None = None, top_p: np.ndarray | None = None,
                min_p: np.ndarray | None = None,
                edits: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """One token per row from ``softmax(filter(edit(logits) / temperature))``.

    Args:
        logits: float32 ``[n, vocab]``; ``-inf`` = excluded (a grammar mask). Not changed.
        u: float64 ``[n]`` uniforms in [0, 1), one per row (the request's own rng draw).
        temperature: float ``[n]`` > 0 (None: 1 everywhere).
        top_k: int ``[n]``, 0 = off (None: off everywhere); ties at the k-th value are all kept.
        top_p: float ``[n]`` in (0, 1], 1 = off: the most likely tokens whose mass (over the top-k
            survivors) first reaches p.
        min_p: float ``[n]`` in [0, 1], 0 = off: tokens below min_p times the best token's probability go.
        edits: ``(rows, cols, values)``: float32 values that replace ``logits[rows, cols]`` before the
            temperature (logit_bias and the penalties, see ``engine.sampling_law``); ``rows`` ascending, no
            ``(row, col)`` twice.
    Returns:
        int64 ``[n]`` token ids.
    """
    n, vocab = logits.shape
    scale = None
    if temperature is not None and np.any(temperature != 1.0):
        scale = np.asarray(temperature, dtype=np.float32)[:, None]
    k = np.zeros(n, dtype=np.int64) if top_k is None else np.asarray(top_k, dtype=np.int64)
    k = np.where((k > 0) & (k < vocab), k, 0)
    p = np.ones(n) if top_p is None else np.asarray(top_p, dtype=np.float64)
    mp = np.zeros(n) if min_p is None else np.asarray(min_p, dtype=np.float64)
    filtered = (k > 0) | (p < 1.0) | (mp > 0.0)
    dense = ~filtered
    num_blocks = -(-vocab // _BLOCK)
    num_groups = vocab // _GROUP_ROWS
    by_groups = (k > 0) & (k <= num_groups)
    # each filtered row's first floor (see _FIRST_CUT; a top-k row's comes from its group maxima)
    min_floor = np.where(mp > 0.0, mp * (1.0 - _MARGIN), 0.0)  # nothing below it survives min-p
    top_p_only = (k == 0) & (p < 1.0)
    large_k = (k > 0) & ~by_groups
    first = np.where(filtered, min_floor, np.inf)
    first[top_p_only | large_k] = np.maximum(_FIRST_CUT, min_floor[top_p_only | large_k])
    step = min(n, max(1, _CACHE_FLOATS // vocab))
    weights = np.empty((step, num_blocks * _BLOCK), dtype=np.float32)  # exp(y - top), zero past the vocab
    weights[:, vocab:] = 0.0
    scratch = np.empty((step, vocab), dtype=np.float32) if scale is not None or edits is not None else None
    ones = np.ones(_BLOCK, dtype=np.float32)
    top = np.empty(n, dtype=np.float32)
    shift = np.empty(n, dtype=np.float32)  # weights are exp(y - shift): shift is top or 0 (see _weights)
    sums = np.empty((n, num_blocks), dtype=np.float32)  # block sums of the weights
    mass = np.empty(n)  # a filtered row's total weight
    found: list[tuple[np.ndarray, ...]] = []  # each group's candidates: (row, col, y, weight)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        # 1. y = edit(logits) / temperature (float32, as the reference), its max, the weights and block sums
        y = _tempered(logits, lo, hi, scale, edits, scratch)
        group_floor = _group_floors(y, k[lo:hi], by_groups[lo:hi], num_groups, top[lo:hi])
        # NOTE(engine): unshifted weights put each row's floors on its own scale; a group of several rows with
        # filters keeps one scale (the best token at 1), so its candidates take one scalar compare (_above)
        w, shift[lo:hi] = _weights(y, top[lo:hi], weights[:hi - lo],
                                   top[lo:hi] if hi - lo > 1 and filtered[lo:hi].any() else None)
        # NOTE(engine): a matrix-vector product sums the blocks (BLAS, ~1e-7 relative in float32): 5x faster
        # than numpy's sum over a short last axis, whose per-block overhead dominates at 64 elements.
        np.matmul(w.reshape(-1, _BLOCK), ones, out=sums[lo:hi].reshape(-1))
        # 2. the filtered rows' candidates, while the group is in cache
        if filtered[lo:hi].any():
            mass[lo:hi] = sums[lo:hi].sum(axis=-1, dtype=np.float64)
            unit = np.exp((top[lo:hi] - shift[lo:hi]).astype(np.float64))  # the best token's weight
            floor = first[lo:hi] * unit
            if group_floor is not None:
                # the weight of a y at the floor, less the margin: every token at or above the floor in y, k of
                # them at least, is a candidate
                mine = by_groups[lo:hi]
                floor[mine] = np.exp(group_floor[mine] - shift[lo:hi][mine]) * (1.0 - _MARGIN)
            row, col, wt = _candidates(w, sums[lo:hi], floor, unit, top_p_only[lo:hi], large_k[lo:hi], k[lo:hi],
                                       p[lo:hi], min_floor[lo:hi] * unit, mass[lo:hi])
            # NOTE(engine): weights relative to the row's best token again, whose float32 weight (the largest
            # candidate's) becomes exactly 1: the draw's one cumsum over every row's candidates must not let
            # one row's e^80 swallow the next row's masses, and top-p's ties at the top are the reference's 1s
            if shift[lo:hi].all():  # shifted: the best token's weight is exp(0) = 1 already
                found.append((row + lo, col, y[row, col], wt.astype(np.float64)))
            else:  # unshifted (one row, see above): a row's largest candidate weight is its best token's
                best = np.ones(hi - lo)
                if hi - lo == 1:
                    best[:] = wt.max()
                elif len(wt):
                    starts = np.flatnonzero(np.diff(row, prepend=-1))  # each row's first candidate
                    best[row[starts]] = np.maximum.reduceat(wt, starts)
                found.append((row + lo, col, y[row, col], wt / best[row]))
                mass[lo:hi] /= best
    tokens = np.empty(n, dtype=np.int64)
    rows = np.flatnonzero(dense)
    if len(rows):  # 3. the dense rows: a block by the block sums, then a token inside it
        tokens[rows] = _draw_dense(logits, rows, sums[rows], u[rows], shift, scale, edits)
    if found:  # 4. the filtered rows: their kept candidates, then a token among them
        row, col, val, wt = (np.concatenate(part) for part in zip(*found))
        _kept_and_drawn(row, col, val, wt, top, mass, u, k, p, mp, tokens)
    return tokens


def _group_floors(y: np.ndarray, k: np.ndarray, by_groups: np.ndarray, num_groups: int,
                  top: np.ndarray) -> np.ndarray | None:
    """Write each row's max of float32 ``y`` ``(m, vocab)`` into ``top``; return the top-k floors of the
    ``by_groups`` rows (float32 y, ``inf`` elsewhere; None when there are none).

    NOTE(engine): a row's k-th best value is at least the k-th largest of the maxima of any k disjoint groups
    of its tokens (those maxima are k distinct tokens). The groups are strided (token i in group i % G, over
    the first 64 G tokens), so their maxima are one vectorized pass over 64 rows of G tokens, which gives the
    row's max too when every row of the group has a top-k.
    """
    m, vocab = y.shape
    if not by_groups.any():
        top[:] = y.max(axis=-1)
        return None
    idx = np.flatnonzero(by_groups)
    width = _GROUP_ROWS * num_groups
    rows = y if len(idx) == m else y[idx]
    maxima = rows[:, :width].reshape(len(idx), _GROUP_ROWS, num_groups).max(axis=1)  # (r, G)
    if len(idx) == m:
        top[:] = maxima.max(axis=-1)
        if vocab > width:
            np.maximum(top, y[:, width:].max(axis=-1), out=top)
    else:
        top[:] = y.max(axis=-1)
    kth = num_groups - k[idx]
    maxima.partition(np.unique(kth), axis=-1)  # every row's k-th largest lands at its own kth
    floor = np.full(m, np.inf, dtype=np.float32)
    floor[idx] = maxima[np.arange(len(idx)), kth]
    return floor


def _weights(y: np.ndarray, top: np.ndarray, out: np.ndarray,
             shift: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``exp(y - shift)`` of float32 ``y`` ``(m, vocab)`` into ``out[:, :vocab]`` (see _SUBNORMAL); ``(out,
    shift)``.

    NOTE(engine): ``shift`` is each row's max, or 0 where every row's max of the group lies within [-60, 80]
    and few of its values below -87 (_deep): then ``exp(y)`` does not overflow (64 weights of at most e^80
    sum to < 2^128), its best weights are normal floats, and the subtraction's pass is saved (-0.1 ms a row
    at 262k). The law only sees the weights relative to one another, so the filters' floors are taken
    relative to the best token's weight, ``exp(top - shift)``.
    """
    vocab = y.shape[1]
    w = out[:, :vocab]
    safe = False  # whether exp(y) may stand unshifted
    if shift is None:
        safe = bool(top.max() <= _DIRECT_MAX and top.min() >= _DIRECT_MIN and not _deep(y))
        shift = np.zeros(len(y), dtype=np.float32) if safe else top.copy()
    base = y
    if shift.any():
        base = np.subtract(y, shift[:, None], out=w)
    deep = not safe and _deep(base)
    if deep:  # see _SUBNORMAL
        base = np.maximum(base, _SUBNORMAL, out=w)
    np.exp(base, out=w)  # -inf -> 0
    if deep:  # what was clamped (masked tokens too) goes to exactly 0
        np.multiply(w, w > _SUBNORMAL_WEIGHT, out=w)
    return out, shift


def _deep(x: np.ndarray) -> bool:
    """Whether more than 1/32 of the finite values of ``x`` (float32 ``(m, width)``) lie below -87, judged on a
    sixteenth of them: the first sixteenth of each of 16 stretches of a row (see _SUBNORMAL: below that share
    a clamp costs more than the subnormals; either way the weights are the law's, a wrong guess only costs
    time).

    NOTE(engine): a sample instead of a min over the rows: the min's pass was 5% of a 262k row at
    temperature 1, and a count of the deep values another pass after it. Contiguous stretches, not every
    16th value: a stride of 64 bytes reads every cache line all the same, without SIMD.
    """
    m, width = x.shape
    stretch = width // 16
    sample = x[:, :16 * stretch].reshape(m, 16, stretch)[:, :, :stretch // 16] if stretch >= 16 else x
    return 32 * np.count_nonzero((sample < _SUBNORMAL) & (sample > -np.inf)) > sample.size


def _tempered(logits: np.ndarray, lo: int, hi: int, scale: np.ndarray | None,
              edits: tuple[np.ndarray, np.ndarray, np.ndarray] | None, scratch: np.ndarray | None) -> np.ndarray:
    """Rows ``lo:hi`` of ``edit(logits) / temperature`` (float32 ``[hi - lo, vocab]``), in ``scratch`` if changed."""
    y = logits[lo:hi] if scale is None else np.divide(logits[lo:hi], scale[lo:hi], out=scratch[:hi - lo])
    if edits is not None:
        rows, cols, values = edits
        a, b = np.searchsorted(rows, [lo, hi])
        if a < b:
            if scale is None:
                y = scratch[:hi - lo]
                np.copyto(y, logits[lo:hi])
                y[rows[a:b] - lo, cols[a:b]] = values[a:b]
            else:  # the edited values divided as the rest: elementwise, the same floats as editing first
                y[rows[a:b] - lo, cols[a:b]] = values[a:b] / scale[rows[a:b], 0]
    return y


def _draw_dense(logits: np.ndarray, rows: np.ndarray, sums: np.ndarray, u: np.ndarray, shift: np.ndarray,
                scale: np.ndarray | None, edits: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> np.ndarray:
    """Inverse-CDF draws over whole rows (``rows`` ascending; ``sums`` their float32 block sums ``(r, nb)``):
    the block where the cdf of the block sums passes ``u * total``, then the token inside it.

    NOTE(engine): the chosen block's 64 weights are computed again from the logits (the same float32 ops as
    the group pass's), so the group pass keeps nothing but the sums: fewer numpy calls per group, which count
    at 262k, where a group is one row.
    """
    vocab = logits.shape[1]
    r = len(rows)
    cdf = np.cumsum(sums, axis=-1, dtype=np.float64)  # (r, nb)
    # NOTE(engine): u * total can round up to the total; one step below it, the target falls in the last
    # block with mass (the first whose cdf reaches the total), never in an empty block past it.
    target = np.minimum(u * cdf[:, -1], np.nextafter(cdf[:, -1], 0.0))
    block = (cdf <= target[:, None]).sum(axis=-1)
    i = np.arange(r)
    below = np.where(block > 0, cdf[i, np.maximum(block - 1, 0)], 0.0)
    # the chosen blocks' weights: (r, B)
    cols = block[:, None] * _BLOCK + np.arange(_BLOCK)
    x = logits[rows[:, None], np.minimum(cols, vocab - 1)]
    if edits is not None:
        e_row, e_col, e_val = edits
        at = np.minimum(np.searchsorted(rows, e_row), r - 1)
        hit = (rows[at] == e_row) & (e_col // _BLOCK == block[at])
        x[at[hit], e_col[hit] % _BLOCK] = e_val[hit]
    if scale is not None:
        np.divide(x, scale[rows], out=x)
    chosen = _weights(x, shift[rows], np.empty_like(x), shift[rows])[0]
    chosen[cols >= vocab] = 0.0
    # NOTE(engine): the target's place inside its block, as a fraction of the block's mass, is laid on the
    # block's own float64 cumsum: no token gains what the float32 block sums lose to rounding.
    fraction = np.minimum(np.maximum((target - below) / sums[i, block], 0.0), 1.0)
    inner = np.cumsum(chosen, axis=-1, dtype=np.float64)
    offset = (inner <= (fraction * inner[:, -1])[:, None]).sum(axis=-1)
    last = _BLOCK - 1 - np.argmax(chosen[:, ::-1] > 0, axis=-1)  # the last token with mass
    return block * _BLOCK + np.minimum(offset, last)


def _above(w: np.ndarray, sums: np.ndarray, floor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row, col)`` of the weights ``w[row, col] >= floor[row]`` (float32 ``(m, width)``, ``(m,)``; ``inf``:
    none), in row-major order, read from the blocks whose sum ``sums`` ``(m, nb)`` reaches the floor."""
    num_blocks = sums.shape[1]
    # NOTE(engine): no floor below _ANY_WEIGHT: a zero floor (a top-k row whose k-th group maximum is -inf, e.g. a
    # grammar mask leaving fewer than k tokens) would take the zero weights too, the padding past the vocab among them
    floor = np.maximum(floor, np.float32(_ANY_WEIGHT))
    picked = np.flatnonzero((sums >= floor[:, None]).ravel())  # row * nb + block
    # NOTE(engine): one scalar compare with the lowest floor, then each hit against its own row's: numpy's
    # compare against a broadcast column of floors costs 5x a scalar one
    lowest = floor.min()
    if 3 * len(picked) > sums.size:  # most blocks qualify: one pass over the rows costs less
        row, col = np.divmod(np.flatnonzero((w >= lowest).ravel()), w.shape[1])
    else:
        hit = np.flatnonzero((w.reshape(-1, _BLOCK)[picked] >= lowest).ravel())  # in the picked (b, B) blocks
        block = picked[hit // _BLOCK]
        row = block // num_blocks
        col = (block - row * num_blocks) * _BLOCK + hit % _BLOCK
    if lowest < floor.max():
        mine = w[row, col] >= floor[row]
        row, col = row[mine], col[mine]
    return row, col


def _candidates(w: np.ndarray, sums: np.ndarray, floor: np.ndarray, unit: np.ndarray, top_p_only: np.ndarray,
                large_k: np.ndarray, k: np.ndarray, p: np.ndarray, min_floor: np.ndarray,
                mass: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The candidates ``(row, col, weight)`` of one group's rows, ``(row, col)`` ascending, each row's from the
    first of its floors (``floor``: its first, ``inf`` for a row without filters) that provably holds its whole
    result (see the NOTE on _FIRST_CUT). Floors are weights: ``unit`` is each row's best token's weight."""
    m = len(floor)
    row, col = _above(w, sums, floor.astype(np.float32))
    weight = w[row, col]
    retry = top_p_only | large_k
    if not retry.any():  # top-k within the groups and min-p: decided at once
        return row, col, weight
    # 1. which rows the first floor decides: the others go on to lower floors
    if large_k.any():
        retry &= ~(large_k & (np.bincount(row, minlength=m) >= k))
    if top_p_only.any():
        held = np.bincount(row, weights=weight, minlength=m)
        retry &= ~(top_p_only & ((floor <= min_floor) | (held >= p * mass)))
    if not retry.any():
        return row, col, weight
    parts = []
    for stage in (1, 2, 3):
        if not retry.any():
            break
        keep = ~retry[row]
        parts.append((row[keep], col[keep], weight[keep]))
        # 2. the next floors (see the NOTE on _FIRST_CUT): top-k 18 nats, then every token with weight (all of
        # a top-k row's survivors count for its top-p); top-p 12.5 nats, the block sums' proven floor, then
        # every token with weight
        floor = np.full(m, np.inf)
        large, nucleus = large_k & retry, top_p_only & retry
        if stage == 1:
            floor[large] = _SECOND_CUT * unit[large]
            floor[nucleus] = np.maximum(_TOP_P_CUT * unit[nucleus], min_floor[nucleus])
        elif stage == 2:
            floor[large] = _ANY_WEIGHT
            again = np.flatnonzero(nucleus)
            if len(again):
                # what lies below floor f in block b weighs at most min(sum_b, B f): the highest f whose
                # bound leaves p of the mass above it
                floors = _TOP_P_FLOORS * unit[again, None]  # (r, F)
                bound = np.minimum(sums[again, None, :], _BLOCK * floors[:, :, None]).sum(axis=-1)
                proven = bound <= ((1.0 - p[again]) * mass[again])[:, None]
                chosen = np.where(proven.any(axis=-1), floors[np.arange(len(again)), proven.argmax(axis=-1)],
                                  _ANY_WEIGHT)
                floor[again] = np.maximum(chosen, min_floor[again])
        else:
            floor[nucleus] = np.maximum(_ANY_WEIGHT, min_floor[nucleus])
        row, col = _above(w, sums, floor.astype(np.float32))
        weight = w[row, col]
        trim = _trimmed(row, weight, nucleus, unit, p, mass)
        row, col, weight = row[trim], col[trim], weight[trim]
        # 3. which rows these floors decide
        decided = ~retry | (floor <= _ANY_WEIGHT)
        decided |= large & (np.bincount(row, minlength=m) >= k)
        decided |= nucleus & ((floor <= min_floor) | (np.bincount(row, weights=weight, minlength=m) >= p * mass))
        retry &= ~decided
    parts.append((row, col, weight))
    row, col, weight = (np.concatenate(part) for part in zip(*parts))
    if m == 1:
        return row, col, weight
    order = np.argsort(row, kind="stable")  # back to row order (stable: each row's cols stay ascending)
    return row[order], col[order], weight[order]


def _trimmed(row: np.ndarray, weight: np.ndarray, rows: np.ndarray, unit: np.ndarray, p: np.ndarray,
             mass: np.ndarray) -> np.ndarray:
    """Which candidates a top-p row of ``rows`` (a mask) may still keep: those down to where its candidates'
    mass first holds p of its whole ``mass``, counted in half-nat levels below its best token (``unit``), and
    one level more; every candidate of the other rows, and of a row whose candidates do not hold p.

    NOTE(engine): a lower floor (the block sums' proven one: 13-20k candidates on a 262k row where 9 nats held
    93% of the mass) gathers ten times the tokens the nucleus needs; what lies past the level that holds p
    cannot be kept, and ranking only the rest costs a tenth. The extra level keeps the tokens that a float32
    exp could order across a level's edge unlike their y, and the margin of 1e-9 the cumsums' rounding.
    """
    keep = np.ones(len(row), dtype=bool)
    mine = np.flatnonzero(rows[row])
    if not len(mine):
        return keep
    r = row[mine]
    level = np.maximum(np.floor(2.0 * np.log(unit[r] / weight[mine])), 0).astype(np.int64)
    width = int(level.max()) + 1
    by_level = np.bincount(r * width + level, weights=weight[mine], minlength=len(rows) * width)
    held = np.cumsum(by_level.reshape(len(rows), width), axis=1)  # (m, levels): mass down to each level
    enough = held >= (p * mass * (1.0 + 1e-9))[:, None]
    last = np.where(enough.any(axis=1), enough.argmax(axis=1) + 1, width)
    keep[mine] = level <= last[r]
    return keep


def _ranked(row: np.ndarray, val: np.ndarray) -> np.ndarray:
    """The order of candidates (given by row, then token id) by row, then value (best first), then token id:
    the reference's stable sort.

    NOTE(engine): one sort of int64 keys (row, value's order-preserving bits, candidate index) instead of a
    lexsort of three keys (50x faster at a few thousand candidates); the candidate index, in the low bits,
    orders ties by token id within a row, and a plain sort of the keys (2.8x faster than an argsort) gives
    the permutation back.
    """
    size = len(row)
    if size and (row[-1] >= 1 << 10 or size >= 1 << 21):  # keys would not fit: the general route
        return np.lexsort((np.arange(size), -val, row))
    bits = (val + np.float32(0.0)).view(np.int32).astype(np.int64)  # + 0.0: -0.0 ties with 0.0, as in the reference
    ordered = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + (1 << 31)  # increasing with val, in [0, 2**32)
    key = (row << 53) | (((1 << 32) - 1 - ordered) << 21) | np.arange(size)
    return np.sort(key) & ((1 << 21) - 1)  # keys are distinct: no tie for the sort to break


def _kept_and_drawn(row: np.ndarray, col: np.ndarray, val: np.ndarray, weight: np.ndarray, top: np.ndarray,
                    mass: np.ndarray, u: np.ndarray, k: np.ndarray, p: np.ndarray, mp: np.ndarray,
                    tokens: np.ndarray) -> None:
    """Every filtered row's kept tokens among its candidates (``row`` ascending, then ``col``; ``val`` their
    float32 y, ``weight`` their float64 weights), then its draw, written into ``tokens``."""
    n = len(top)
    count = np.bincount(row, minlength=n)
    start = np.cumsum(count) - count
    keep = np.ones(len(row), dtype=bool)
    if ((k > 0) | (p < 1.0))[row].any():
        # 1. rank each row's candidates: best first, ties by token id
        order = _ranked(row, val)
        s_row, s_val, s_w = row[order], val[order], weight[order]
        # 2. top-k: the k-th best value; everything at least as good stays (ties included)
        has_k = k > 0
        total = mass  # what top-p measures against: the row's mass, or its top-k survivors'
        if has_k.any():
            enough = has_k & (count >= k)
            kth = np.full(n, -np.inf, dtype=np.float32)
            kth[enough] = s_val[start[enough] + k[enough] - 1]
            s_keep = s_val >= kth[s_row]
            s_w = np.where(s_keep, s_w, 0.0)
            live = count > 0
            row_kept = np.zeros(n)
            row_kept[live] = np.add.reduceat(s_w, start[live])
            total = np.where(has_k, row_kept, mass)
        else:
            s_keep = np.ones(len(order), dtype=bool)
        # 3. top-p over the top-k survivors (or the whole row): kept while the mass ranked above is < p
        # (every row with candidates holds its best token, of weight 1: no total is 0)
        if (p < 1.0).any():
            probs = s_w / total[s_row]
            csum = np.cumsum(probs)
            first = np.minimum(start, len(order) - 1)
            before = csum - probs - (csum[first] - probs[first])[s_row]  # mass ranked above, within the row
            # NOTE(engine): one cumsum over the rows rounds a row's sums as a cumsum over that row alone (the
            # reference's) does not; where a row's mass ranked above lands on p within that rounding (ties at
            # the top, e.g. 10 tied survivors and p = 0.9), the row's own cumsum decides, as the reference's
            near = np.flatnonzero((np.abs(before - p[s_row]) <= 1e-9) & (p[s_row] < 1.0))
            for r in np.unique(s_row[near]) if len(near) else ():
                mine = slice(start[r], start[r] + count[r])
                before[mine] = np.cumsum(probs[mine]) - probs[mine]
            s_keep &= ~(p < 1.0)[s_row] | (before < p[s_row])
        keep[order] = s_keep
    # 4. min-p last: what lies below top + log(min_p) goes (a float64 threshold, as the reference's)
    if (mp > 0.0).any():
        keep &= ~(mp[row] > 0.0) | ~(val < top[row] + np.log(np.where(mp > 0.0, mp, 1.0))[row])
    # 5. the draw among the kept candidates, in token-id order
    rows = np.flatnonzero(count)
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
