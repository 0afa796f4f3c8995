"""The vectorized sampled path (engine.sampling_fast.draw_tokens via sample_batch) against the reference law
(RequestSampler.process, then softmax): the same token for the same uniform draw, and the law itself checked
by Pearson's chi-square at batch 8, every row with its own params."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import sampling_fast
from engine.sampler import RequestSampler, _edits, _sample_rows, sample_batch
from engine.sampling_fast import draw_tokens
from engine.sampling_law import apply_token_bitmask
from engine.types import SamplingParams
from tests.chi_square import chi_square_p_value, upper_gamma_regularized


def reference_probs(sampler: RequestSampler, logits: np.ndarray) -> np.ndarray:
    """The law: softmax of the reference transforms, in float64."""
    processed = sampler.process(logits).astype(np.float64)
    probs = np.exp(processed - processed.max())
    return probs / probs.sum()


def reference_token(sampler: RequestSampler, logits: np.ndarray, u: float) -> int:
    """The reference draw: the token where the float64 CDF of the law, in token-id order, passes u."""
    cdf = np.cumsum(reference_probs(sampler, logits))
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


def test_chi_square_helper_on_known_values() -> None:
    # chi-square survival function: df 2 at x is exp(-x / 2); df 10 at 18.307 is 0.05
    assert upper_gamma_regularized(1.0, 3.0) == pytest.approx(math.exp(-3.0), rel=1e-9)
    assert upper_gamma_regularized(5.0, 18.307 / 2) == pytest.approx(0.05, abs=1e-4)
    assert upper_gamma_regularized(5.0, 3.0) == pytest.approx(1 - 0.18473675547622792, rel=1e-6)


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([1.0, 0.3, 0.7, 1.3]),
    top_k=st.sampled_from([0, 0, 2, 5, 40, 1000]),
    top_p=st.sampled_from([1.0, 1.0, 0.3, 0.9, 0.95, 0.999]),
    min_p=st.sampled_from([0.0, 0.0, 0.01, 0.2, 1e-9]),
)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([37, 300, 1000, 4096]), st.lists(params_strategy, min_size=1,
       max_size=8), st.booleans(), st.booleans())
def test_draw_tokens_picks_the_reference_token_for_the_same_draw(seed, vocab, params, ties, masked):
    """Every row of a batch, whatever its filters (the candidate rounds, the group floor of top-k, the dense
    rows), picks exactly the token the reference law's inverse CDF gives at the same u."""
    rng = np.random.default_rng(seed)
    n = len(params)
    logits = (rng.normal(size=(n, vocab)) * rng.uniform(0.5, 5.0)).astype(np.float32)
    if ties:
        logits = np.round(logits)  # many exact ties: top-k keeps them all, top-p ranks them by token id
    if masked:
        logits[:, rng.integers(0, vocab, vocab // 2)] = -np.inf
        logits[:, 0] = 0.0  # a row keeps something allowed
    u = rng.random(n)
    samplers = [RequestSampler(p, [], vocab) for p in params]
    got = draw_tokens(logits, u, temperature=np.array([p.temperature for p in params]),
                      top_k=np.array([p.top_k for p in params]), top_p=np.array([p.top_p for p in params]),
                      min_p=np.array([p.min_p for p in params]))
    assert got.tolist() == [reference_token(s, row, x) for s, row, x in zip(samplers, logits, u)]
    assert all(np.isfinite(logits[i, t]) for i, t in enumerate(got))


def test_real_width_rows_pick_the_reference_token():
    """49,152-wide rows shaped like a language model's (a few strong tokens, a long tail), the filters
    clients send: the same token as the reference for every draw."""
    rng = np.random.default_rng(3)
    vocab = 49152
    logits = (rng.gumbel(size=(8, vocab)) * 1.5).astype(np.float32)
    logits[np.arange(8)[:, None], rng.integers(0, vocab, (8, 30))] += rng.uniform(4, 12, (8, 30)).astype(np.float32)
    cases = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_p=0.95),
             SamplingParams(top_k=40), SamplingParams(min_p=0.05),
             SamplingParams(temperature=0.8, top_k=40, top_p=0.95), SamplingParams(top_p=0.9999),
             SamplingParams(top_k=5000)]
    samplers = [RequestSampler(p, [], vocab) for p in cases]
    for _ in range(25):
        u = rng.random(8)
        got = draw_tokens(logits, u, temperature=np.array([p.temperature for p in cases]),
                          top_k=np.array([p.top_k for p in cases]), top_p=np.array([p.top_p for p in cases]),
                          min_p=np.array([p.min_p for p in cases]))
        assert got.tolist() == [reference_token(s, row, x) for s, row, x in zip(samplers, logits, u)]


def test_the_law_holds_for_every_row_of_a_batch():
    """Eight kinds of row, each with its own params (plain, temperature, top-k, top-p, min-p, all of them,
    penalties with logit_bias, a grammar mask), mixed in one batch: 4,000 draws of each, every kind's counts
    against its exact law."""
    rng = np.random.default_rng(11)
    vocab = 24
    logits = (rng.normal(size=(8, vocab)) * 1.5).astype(np.float32)
    params = [SamplingParams(), SamplingParams(temperature=0.6), SamplingParams(top_k=6),
              SamplingParams(top_p=0.8), SamplingParams(min_p=0.15),
              SamplingParams(temperature=1.4, top_k=10, top_p=0.9, min_p=0.02),
              SamplingParams(presence_penalty=0.8, frequency_penalty=0.3, repetition_penalty=1.3,
                             logit_bias=((3, 2.0), (5, -5.0))),
              SamplingParams(temperature=0.9, top_p=0.95)]
    prompt = [1, 2, 3, 4]
    bitmask = np.full((8, 1), -1, dtype=np.int32)
    bitmask[7, 0] = 0b1010_1010_1010_1010_1010_1010  # row 7: only some tokens allowed by the "grammar"
    # 8 steps of a 4,000-row batch: 500 copies of each of the 8 rows, interleaved, each its own request
    # (a fresh sampler per step: penalties would otherwise change the law as tokens are recorded)
    copies, num_steps = 500, 8
    num_samples = copies * num_steps
    batch_logits = np.tile(logits, (copies, 1))  # row j is logits[j % 8]
    batch_mask = np.tile(bitmask, (copies, 1))
    rng = np.random.default_rng(100)
    counts = np.zeros((8, vocab), dtype=np.int64)
    for _ in range(num_steps):
        samplers = [RequestSampler(params[j % 8], prompt, vocab, rng=np.random.default_rng(rng.integers(2**63)))
                    for j in range(8 * copies)]
        results = sample_batch(batch_logits, samplers, batch_mask, masked_rows=range(7, 8 * copies, 8))
        for j, res in enumerate(results):
            counts[j % 8, res.token_id] += 1
    masked = apply_token_bitmask(logits[7], bitmask[7])
    for i, p in enumerate(params):
        row = masked if i == 7 else logits[i]
        law = reference_probs(RequestSampler(p, prompt, vocab), row)
        assert counts[i][law == 0].sum() == 0, f"row {i} drew a token its law excludes"
        stat, p_value, df = chi_square_p_value(counts[i].tolist(), (num_samples * law).tolist())
        assert p_value > 1e-4, f"row {i} ({p}): chi-square {stat:.1f} on {df} df, p = {p_value:.2e}"
    # the test tells laws apart: row 1 (temperature 0.6) is far from temperature 1's law
    plain = reference_probs(RequestSampler(SamplingParams(), prompt, vocab), logits[1])
    _, p_wrong, _ = chi_square_p_value(counts[1].tolist(), (num_samples * plain).tolist())
    assert p_wrong < 1e-6


def test_a_row_gets_the_same_token_alone_and_in_any_batch():
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(8, 5000)) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1)
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(min_p=0.1, seed=3),
              SamplingParams(top_k=3, presence_penalty=1.0)]
    alone = RequestSampler(params, [], 5000)
    mine = RequestSampler(params, [], 5000)
    for step in range(20):
        batch = [RequestSampler(p, [], 5000) for p in others[:step % 5]]
        solo = sample_batch(logits[:1], [alone])[0].token_id
        mixed = sample_batch(logits[:1 + len(batch)], [mine, *batch])[0].token_id
        assert solo == mixed


penalty_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([1.0, 1.0, 0.0, 0.7]),
    top_k=st.sampled_from([0, 0, 3]),
    top_p=st.sampled_from([1.0, 1.0, 0.9]),
    min_p=st.sampled_from([0.0, 0.0, 0.05]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.3, 0.8]),
    logit_bias=st.sampled_from([(), (), ((3, 2.0), (5, -100.0)), ((7, 1.5), (7, 1.5))]),
)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([37, 64, 300, 2048]), st.lists(penalty_strategy, min_size=1,
       max_size=8), st.booleans())
def test_sample_batch_picks_the_reference_token_with_penalties_greedy_rows_and_masks(seed, vocab, params, masked):
    """A batch of requests over several steps, each its own penalties, logit_bias (an id twice too), greedy
    or sampled, some rows masked: every step, every row's token is the one the reference law (``process`` on
    a twin sampler that saw the same tokens, then the float64 inverse CDF at the twin's own draw) gives."""
    rng = np.random.default_rng(seed)
    n = len(params)
    prompt = rng.integers(0, vocab, 12).tolist()
    mine = [RequestSampler(p, prompt, vocab, rng=np.random.default_rng(seed + i)) for i, p in enumerate(params)]
    twins = [RequestSampler(p, prompt, vocab, rng=np.random.default_rng(seed + i)) for i, p in enumerate(params)]
    words = -(-vocab // 32)
    for _ in range(6):
        logits = (rng.normal(size=(n, vocab)) * 3).astype(np.float32)
        bitmask = rng.integers(-2**31, 2**31, (n, words), dtype=np.int64).astype(np.int32)
        bitmask[:, 0] |= 1  # token 0 stays allowed
        rows = list(range(0, n, 2)) if masked else []
        got = [r.token_id for r in sample_batch(logits, mine, bitmask, masked_rows=rows)]
        want = []
        for i, twin in enumerate(twins):
            row = apply_token_bitmask(logits[i], bitmask[i]) if i in rows else logits[i]
            if twin.greedy:
                token = int(np.argmax(twin.process(row)))
            else:
                token = reference_token(twin, row, twin.rng.random())
            twin.record(token)
            want.append(token)
        assert got == want
        masked_out = [i for i in rows if not np.isfinite(apply_token_bitmask(logits[i], bitmask[i])[got[i]])]
        assert not masked_out


def test_penalty_edits_are_the_reference_rows_bit_for_bit():
    """The batch's sparse edits (logit_bias, repetition, presence, frequency, alone and together, after a
    history of tokens with repeats) give ``process``'s rows exactly: the same float32 operations in order."""
    rng = np.random.default_rng(7)
    vocab = 500
    params = [SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=0.3),
              SamplingParams(repetition_penalty=1.3), SamplingParams(logit_bias=((3, 2.0), (3, 0.5), (9, -100.0))),
              SamplingParams(presence_penalty=-0.7, frequency_penalty=0.2, repetition_penalty=0.9,
                             logit_bias=((3, 2.0),)),
              SamplingParams(logit_bias=((9, 1.5), (2, -3.0))), SamplingParams()]
    samplers = [RequestSampler(p, rng.integers(0, vocab, 30).tolist(), vocab) for p in params]
    for s in samplers:
        for token in rng.integers(0, 40, 200):  # repeats: counts up to ~10
            s.record(int(token))
    logits = (rng.normal(size=(len(params), vocab)) * 4).astype(np.float32)
    # the whole batch (several kinds of edit meet), each row alone, the output-only rows together
    for rows_of in [list(range(len(params)))] + [[i] for i in range(len(params) - 1)] + [[0, 1], [5, 6]]:
        edited = logits[rows_of].copy()
        rows, cols, values = _edits(logits[rows_of], [samplers[i] for i in rows_of])
        assert np.all(np.diff(rows) >= 0) and len(set(zip(rows.tolist(), cols.tolist()))) == len(rows)
        edited[rows, cols] = values
        for j, i in enumerate(rows_of):
            assert edited[j].tobytes() == samplers[i].process(logits[i]).tobytes(), f"row {i}: {params[i]}"
    assert _edits(logits[-1:], samplers[-1:]) is None


def test_deep_rows_clamp_exactly_and_never_draw_a_masked_token():
    """Rows that reach below -87 nats (a low temperature, a logit_bias of -100) get their clamped weights set
    to exactly 0 (not the subnormals that cost 13-50x): the reference's token for every u, and a masked (-inf)
    token never (the extreme draws too: 0, and 1 less 2**-53), whatever the filters.

    NOTE(engine): token for token holds where float64 tells the tokens apart: the batch's draw runs one float64
    cumsum over every row's kept tokens, so a row resolves its cdf to the ulp of the rows' summed mass before
    it, not of its own, which shows at u within ~1e-15 of 0 or 1 only.
    """
    rng = np.random.default_rng(9)
    vocab = 4096
    logits = (rng.normal(size=(6, vocab)) * 4).astype(np.float32)
    logits[:, ::3] = -np.inf  # a grammar mask, its first token included
    logits[:, 1] = logits[:, 1::3].max(axis=1) - 90.0  # a deep allowed token ahead of the others
    params = [SamplingParams(temperature=0.05), SamplingParams(temperature=0.2, top_p=0.9),
              SamplingParams(temperature=0.1, top_k=5), SamplingParams(temperature=0.1, min_p=0.01),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.3, top_k=1000)]
    samplers = [RequestSampler(p, [], vocab) for p in params]
    for u_value in [0.0, 2**-53, 1e-6, 0.3, 0.7, 1 - 1e-6, 1 - 2**-53, *rng.random(20)]:
        u = np.full(len(params), u_value)
        got = draw_tokens(logits, u, temperature=np.array([p.temperature for p in params]),
                          top_k=np.array([p.top_k for p in params]), top_p=np.array([p.top_p for p in params]),
                          min_p=np.array([p.min_p for p in params]))
        assert np.isfinite(logits[np.arange(len(params)), got]).all()
        if 1e-9 < u_value < 1 - 1e-9:
            assert got.tolist() == [reference_token(s, row, u_value) for s, row in zip(samplers, logits)]


def test_later_floors_hold_the_result(monkeypatch):
    """Rows whose first floor (9 nats below the best) cannot hold the result: a top-p row whose mass lies 10
    nats down (12.5 nats holds it), one 14 nats down (the block sums' proven floor), one 30 nats down with a
    top-p so close to 1 that no floor is proven (every token with weight), a top-k beyond vocab // 64 (18
    nats, then every token). Those floors really run, row by row, and every draw is the reference's."""
    floors_used: list[list[float]] = [[] for _ in range(5)]
    above = sampling_fast._above

    def spy(w, sums, floor):
        for i, f in enumerate(floor.tolist()):
            if np.isfinite(f):
                floors_used[i].append(round(float(np.log(f)), 3))
        return above(w, sums, floor)

    monkeypatch.setattr(sampling_fast, "_above", spy)
    rng = np.random.default_rng(13)
    vocab = 4096
    logits = rng.normal(size=(5, vocab)).astype(np.float32) * 0.01
    logits[[0, 2, 4]] -= 10.0  # the rest 10 nats down: the best token below holds ~85% of the mass
    logits[3] -= 14.0  # 14 nats down: the best token holds 99.7%
    logits[1] -= 30.0
    logits[4, :2000] = -25.0  # the top-k row: 2,000 tokens 25 nats down
    logits[:, 17] = 0.0
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=1 - 1e-16), SamplingParams(top_p=0.5),
              SamplingParams(top_p=0.999), SamplingParams(top_k=3000)]
    samplers = [RequestSampler(p, [], vocab) for p in params]
    for _ in range(30):
        u = rng.random(len(params))
        got = draw_tokens(logits, u, top_k=np.array([p.top_k for p in params]),
                          top_p=np.array([p.top_p for p in params]), min_p=np.zeros(len(params)))
        assert got.tolist() == [reference_token(s, row, x) for s, row, x in zip(samplers, logits, u)]
    tiny = round(float(np.log(np.finfo(np.float32).tiny)), 3)
    assert set(floors_used[0]) == {-9.0, -12.5}
    assert set(floors_used[1]) == {-9.0, -12.5, tiny}
    assert set(floors_used[2]) == {-9.0}
    assert len(set(floors_used[3])) == 3 and -41.0 < min(floors_used[3]) < -12.5  # a floor the sums prove
    assert set(floors_used[4]) == {-9.0, -18.0, tiny}


def test_top_p_ties_that_land_on_p_round_as_the_reference():
    """Ten tokens tied at the top, top-k 5 (ties kept) and top-p 0.9: the mass ranked above the tenth is 0.9 in
    exact arithmetic, 0.8999999999999999 in the reference's cumsum over its row, so the reference keeps it;
    so must the batch, whatever rows come before it in the batch's one cumsum (the row's own cumsum then
    decides)."""
    vocab = 300
    logits = np.full((3, vocab), -3.0, dtype=np.float32)
    logits[:, 10:20] = 2.0  # ten ties at the top
    logits[0, :5] = 1.5  # rows before it with other masses
    params = [SamplingParams(top_p=0.999), SamplingParams(top_k=200, top_p=0.95),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]
    samplers = [RequestSampler(p, [], vocab) for p in params]
    assert np.count_nonzero(reference_probs(samplers[2], logits[2])) == 10
    for x in np.linspace(0.005, 0.995, 100):
        u = np.full(3, x)
        got = draw_tokens(logits, u, temperature=np.array([p.temperature for p in params]),
                          top_k=np.array([p.top_k for p in params]), top_p=np.array([p.top_p for p in params]))
        assert got.tolist() == [reference_token(s, row, x) for s, row in zip(samplers, logits)]
    assert draw_tokens(logits[2:], np.array([0.995]), temperature=np.array([0.7]), top_k=np.array([5]),
                       top_p=np.array([0.9]))[0] == 19  # the tenth tie


@pytest.mark.parametrize("vocab", [300, 4096])
def test_edits_that_move_the_max_move_the_filters(vocab):
    """At temperature 1 the penalties and logit_bias are laid over the logits rather than copied in; the row's
    max must still be the edited row's: a presence penalty on the best token (min-p's threshold falls with
    it), a logit_bias lifting a low token 0.3 above the rest, also one among the row's last tokens (past
    64 * (vocab // 64)): min-p then drops a token 1 nat below the old max. Every draw the reference's."""
    rng = np.random.default_rng(21)
    logits = (rng.normal(size=(4, vocab)) * 2).astype(np.float32)
    best = int(np.argmax(logits[0]))
    for i, token in ((1, 5), (2, vocab - 1)):
        logits[i, 7] = logits[i].max() - 1.0  # min-p 0.3 (1.2 nats) keeps it from the old max, not the new
        logits[i, token] = logits[i].max() - 11.7  # the bias of 12 lifts it 0.3 above the rest
    params = [SamplingParams(presence_penalty=2.0, min_p=0.3), SamplingParams(logit_bias=((5, 12.0),), min_p=0.3),
              SamplingParams(logit_bias=((vocab - 1, 12.0),), min_p=0.3),
              SamplingParams(frequency_penalty=2.0, top_k=2, top_p=0.8)]
    samplers = [RequestSampler(p, [], vocab, rng=np.random.default_rng(i)) for i, p in enumerate(params)]
    twins = [RequestSampler(p, [], vocab, rng=np.random.default_rng(i)) for i, p in enumerate(params)]
    for s in samplers[:1] + twins[:1] + samplers[3:] + twins[3:]:
        s.record(best)
        s.record(int(np.argmax(logits[3])))
    for _ in range(40):
        got = [r.token_id for r in _sample_rows(logits, samplers)]
        assert got == [reference_token(t, row, t.rng.random()) for t, row in zip(twins, logits)]
