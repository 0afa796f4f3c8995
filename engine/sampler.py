"""Sampling on the CPU: a per-request sampler built from SamplingParams, and a step's batch sampled at once.

The law is ``engine.sampling_law`` (the reference transforms); the batch takes the fast path of
``engine.sampling_fast`` where it picks the same tokens. No onnxruntime import. Shapes: ``logits`` is float32
``[..., vocab]`` (one row per request); filtered-out tokens are ``-inf``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from engine.sampling_fast import draw_tokens
from engine.sampling_law import (
    apply_logit_bias, apply_min_p, apply_penalties, apply_temperature, apply_token_bitmask, apply_top_k, apply_top_p,
    log_softmax, token_allowed, top_logprobs,
)
from engine.spec_decode import rejection
from engine.types import SamplingParams, TokenLogprob

# NOTE(engine): a greedy batch's pass splits its rows over threads above this many logits (numpy's ufuncs release
# the GIL) on machines of 4 cores or more; below it one thread is faster than the hand-off. 128k vocab: batch 32+.
# Tried: splitting batch 8 with logprobs too (1M logits): the work moved to the pool but took no less wall time
# (the decode_sample phase, docs/perf/GPU.md).
_THREADED_LOGITS = 1 << 22
_pool: ThreadPoolExecutor | None = None


def _rows_pass(logits: np.ndarray, scratch: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of float32 ``[n, V]`` logits: its argmax, its max and (with ``scratch``, the same shape)
    ``log(sum(exp(x - max)))``, else zeros."""
    best = logits.argmax(axis=-1)  # [n]
    top = np.take_along_axis(logits, best[:, None], axis=-1)  # [n, 1]
    if scratch is None:
        return best, top[:, 0], np.zeros(len(best), dtype=logits.dtype)
    np.subtract(logits, top, out=scratch)
    np.exp(scratch, out=scratch)
    return best, top[:, 0], np.log(scratch.sum(axis=-1))


def greedy_pass(logits: np.ndarray, normalizers: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(argmax, max, log_sum)`` of every row of float32 ``[n, V]`` logits in one pass; ``log_sum`` is
    ``log(sum(exp(x - max)))`` with ``normalizers`` (else zeros), so a token's log-probability is
    ``(x[token] - max) - log_sum``, ``log_softmax``'s value operation for operation.

    NOTE(engine): large batches split their rows over threads (numpy's ufuncs release the GIL): at batch 64 and
    128k vocab a per-row log-softmax cost ~5x the GPU step's model run, and even the argmax alone a third of it
    (docs/perf/GPU.md).
    """
    global _pool
    n = logits.shape[0]
    scratch = np.empty_like(logits) if normalizers else None
    if logits.size < _THREADED_LOGITS or n < 2 or (os.cpu_count() or 1) < 4:
        return _rows_pass(logits, scratch)
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="ortserve-rows")
    bounds = np.linspace(0, n, min(n, _pool._max_workers) + 1).astype(int)
    parts = list(_pool.map(lambda r: _rows_pass(logits[r[0]:r[1]], None if scratch is None else scratch[r[0]:r[1]]),
                           zip(bounds[:-1], bounds[1:])))
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]


def batch_logprobs(logits: np.ndarray, token_ids: Sequence[int], top_n: Sequence[int],
                   top: np.ndarray | None = None, log_sum: np.ndarray | None = None,
                   rows: Sequence[int] | None = None) -> list[TokenLogprob]:
    """The log-probability of ``token_ids[i]`` under ``softmax(logits[i])`` for every row of float32 ``[n, V]``
    logits, with the row's ``top_n[i]`` most likely alternatives (``log_softmax``'s values, operation for
    operation). ``top`` and ``log_sum`` are ``greedy_pass``'s, computed here when not given. ``rows``: the rows of
    ``logits`` meant, one per token (None: all), read in place."""
    if rows is None:
        rows = range(len(token_ids))
    if top is None or log_sum is None:
        _, top, log_sum = greedy_pass(logits[list(rows)], normalizers=True)
    out = []
    for i, (r, token, k) in enumerate(zip(rows, token_ids, top_n)):
        row = logits[r]
        alternatives: tuple[tuple[int, float], ...] = ()
        if k > 0:
            k = min(k, row.shape[-1])
            idx = np.argpartition(row, -k)[-k:]
            idx = idx[np.argsort(-row[idx], kind="stable")]
            alternatives = tuple((int(j), float((row[j] - top[i]) - log_sum[i])) for j in idx if row[j] > -np.inf)
        out.append(TokenLogprob(int(token), float((row[token] - top[i]) - log_sum[i]), alternatives))
    return out


def label_logprobs(row: np.ndarray, token_id: int, label_ids: np.ndarray) -> TokenLogprob:
    """The log-probabilities of ``label_ids`` (and of the sampled ``token_id``) under ``softmax(row)``, one row of
    raw float32 ``[V]`` logits, computed in float64 so that rounding stays far below the 1e-4 a decision's
    probabilities are compared at. ``top`` lists ``(label id, logprob)`` in the order of ``label_ids``.

    NOTE(engine): the raw distribution, not the sampling one: no bias, penalties, temperature or mask, as vLLM's
    and SGLang's decision endpoints read it (their "raw_logprobs" mode).
    """
    x = row.astype(np.float64)
    top = x.max()
    log_sum = top + np.log(np.exp(x - top).sum())  # log(sum(exp(x)))
    labels = tuple((int(t), float(x[t] - log_sum)) for t in label_ids.tolist())
    return TokenLogprob(int(token_id), float(x[token_id] - log_sum), labels)


def sample_from(logits: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from ``softmax(logits)`` (1-D, ``-inf`` = excluded) with one ``rng.random()``."""
    return int(draw_tokens(logits[None], np.array([rng.random()]))[0])


@dataclass
class SampleResult:
    """What the sampler picked for one request in one step."""

    token_id: int
    logprob: TokenLogprob | None = None


class RequestSampler:
    """The sampling chain of one request: its params, its own rng and its penalty state.

    NOTE(engine): the rng belongs to the request (seeded from ``params.seed``), and it draws exactly one
    number per sampled token, so the same seed gives the same text whatever else is in the batch.

    ``process`` is the reference law (the ``apply_*`` transforms in order); ``sample`` and ``sample_batch``
    draw from it by a faster route (``adjust``, then ``engine.sampling_fast.draw_tokens``) that picks the same
    token for the same uniform draw.

    Args:
        params: the request's SamplingParams.
        prompt_ids: the prompt (the repetition penalty looks at it).
        vocab_size: logits width.
        rng: the generator to draw from (the engine's spawned one for an unseeded request, a seed-derived one
            for choice i > 0 of a seeded n > 1 request); None -> seeded from ``params.seed`` (else fresh entropy).
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
                 rng: np.random.Generator | None = None) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.rng = rng if rng is not None else np.random.default_rng(params.seed)
        self.greedy = params.greedy
        self.use_penalties = (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                              or params.repetition_penalty != 1.0)
        self.use_filters = not self.greedy and (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0)
        self.want_logprobs = params.logprobs or params.top_logprobs > 0
        # decisions / rerank: the labels whose log-probabilities the first token's output carries (None: none)
        self.label_ids = (np.array(params.label_token_ids, dtype=np.int64)
                          if params.label_token_ids and max(params.label_token_ids) < vocab_size else None)
        # NOTE(engine): ids outside the vocab (logit_bias) are ignored rather than crash the batch.
        bias = [(t, b) for t, b in params.logit_bias if 0 <= t < vocab_size]
        self.bias_ids = np.array([t for t, _ in bias], dtype=np.int64)
        self.bias_values = np.array([b for _, b in bias], dtype=np.float32)
        self.bias_unique = len(set(self.bias_ids.tolist())) == len(self.bias_ids)  # (a dict's are)
        self.output_counts: np.ndarray | None = None
        self.seen_mask: np.ndarray | None = None
        # NOTE(engine): the penalties touch only tokens seen so far; these arrays name them (each id once, the
        # first num_* entries; grown by doubling), so a step costs the number of distinct tokens seen, not the
        # vocabulary, and a batch's penalties are a few vectorized operations over all its rows (_edits).
        self._seen_ids = np.empty(0, dtype=np.int64)  # prompt and output (the repetition penalty)
        self._output_ids = np.empty(0, dtype=np.int64)  # output (presence and frequency)...
        self._output_id_counts = np.empty(0, dtype=np.int32)  # ... and how often each was generated
        self._output_slot: dict[int, int] = {}  # token id -> its place in _output_ids
        self.num_seen = self.num_output = 0
        if self.use_penalties:
            self.output_counts = np.zeros(vocab_size, dtype=np.int32)
            self.seen_mask = np.zeros(vocab_size, dtype=bool)
            prompt = np.asarray(prompt_ids, dtype=np.int64)
            self.seen_mask[prompt[(prompt >= 0) & (prompt < vocab_size)]] = True
            self._seen_ids = np.flatnonzero(self.seen_mask)
            self.num_seen = len(self._seen_ids)
        # A plain request is one argmax of the raw logits.
        self.plain_greedy = self.greedy and not self.use_penalties and len(self.bias_ids) == 0
        self.needs_adjust = self.use_penalties or len(self.bias_ids) > 0

    def process(self, logits: np.ndarray) -> np.ndarray:
        """The processed logits of one row (float32 ``[vocab]``); the input is not changed. The reference law:
        sampling draws from ``softmax`` of this (greedy takes its argmax)."""
        p = self.params
        out = logits
        if len(self.bias_ids):
            out = apply_logit_bias(out, self.bias_ids, self.bias_values)
        if self.use_penalties:
            out = apply_penalties(out, self.output_counts, self.seen_mask, presence=p.presence_penalty,
                                  frequency=p.frequency_penalty, repetition=p.repetition_penalty)
        if self.greedy:
            return out
        if p.temperature != 1.0:
            out = apply_temperature(out, p.temperature)
        if p.top_k > 0:
            out = apply_top_k(out, p.top_k)
        if p.top_p < 1.0:
            out = apply_top_p(out, p.top_p)
        if p.min_p > 0.0:
            out = apply_min_p(out, p.min_p)
        return out

    def sample(self, logits: np.ndarray) -> SampleResult:
        """Pick the next token from one row of raw logits (float32 ``[vocab]``); ``sample_batch`` records it
        (``verify`` too), a direct caller calls ``record``."""
        return _sample_rows(logits[None], [self])[0]

    def verify(self, logits: np.ndarray, draft: Sequence[int],
               draft_probs: np.ndarray | None = None) -> list[SampleResult]:
        """Check a draft (speculative decoding) and record the tokens it yields.

        Args:
            logits: float32 ``[len(draft) + 1, vocab]``: row 0 follows the request's last token, row j + 1
                follows ``draft[j]`` (one model run over the last token and the draft).
            draft: the proposed next tokens.
            draft_probs: float ``[len(draft), vocab]``: the distribution q each draft token was drawn from (a draft
                model's); None: point masses (prompt lookup), or a greedy request (q plays no part then).
        Returns:
            The tokens to append: the longest draft prefix the model's own choices reproduce, then the model's
            choice where they part (or after the whole draft): 1 to ``len(draft) + 1`` results.

        NOTE(engine): each position picks its token exactly as ``sample`` does on that row (same processing,
        penalties counting the tokens accepted before it, one rng draw), and a draft token is kept when it
        is that choice. The output is therefore plain decoding's, token for token and draw for draw, so a
        seeded request gives the same text with or without drafts. For a deterministic (point-mass) draft
        this is the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): draft token t is
        kept with probability p(t), and on rejection the token comes from p without t, renormalized.
        transformers' assisted generation checks drafts without logits (prompt lookup) the same way.
        """
        if draft_probs is not None and not self.greedy:
            return self._speculative_sampling(logits, draft, draft_probs)
        if self.plain_greedy:  # NOTE(engine): one argmax pass over the rows, log-probabilities of the kept rows only
            rows = logits[:len(draft) + 1]
            tokens = np.argmax(rows, axis=-1)
            n = next((j + 1 for j, t in enumerate(draft) if int(tokens[j]) != t), len(draft) + 1)
            kept = [int(t) for t in tokens[:n]]
            logprobs = batch_logprobs(rows[:n], kept, [self.params.top_logprobs] * n) if self.want_logprobs else None
            for t in kept:
                self.record(t)
            return [SampleResult(t, logprobs[j] if logprobs else None) for j, t in enumerate(kept)]
        results: list[SampleResult] = []
        for j, row in enumerate(logits[:len(draft) + 1]):
            result = self.sample(row)
            self.record(result.token_id)
            results.append(result)
            if j == len(draft) or result.token_id != draft[j]:
                break
        return results

    def _speculative_sampling(self, logits: np.ndarray, draft: Sequence[int],
                              draft_probs: np.ndarray) -> list[SampleResult]:
        """``verify`` of a draft drawn from ``draft_probs`` (q): position j keeps ``draft[j]`` with min(1, p/q), p
        being this sampler's law on row j (``process``, penalties counting the tokens kept before it); the first
        rejected position draws from the normalised residual max(0, p - q), and a draft kept whole gets a bonus
        token drawn from p on its last row. The tokens follow p exactly (``engine.spec_decode.rejection``)."""
        results: list[SampleResult] = []
        for j in range(len(draft) + 1):
            row = logits[j]
            p = rejection.probabilities(self.process(row))
            kept = j < len(draft)
            if not kept:
                token = rejection.draw(p, self.rng.random())
            else:
                q = draft_probs[j]
                token = draft[j]
                if not rejection.accept(p[token], q[token], self.rng.random()):
                    kept = False
                    token = rejection.draw(rejection.residual(p, q), self.rng.random())
            results.append(SampleResult(token, self.logprob_of(row, token) if self.want_logprobs else None))
            self.record(token)
            if not kept:
                break
        return results

    def logprob_of(self, logits: np.ndarray, token_id: int) -> TokenLogprob:
        """Log-probability of ``token_id`` under the model's raw distribution, plus the top alternatives."""
        lp = log_softmax(logits)
        return TokenLogprob(token_id, float(lp[token_id]), top_logprobs(lp, self.params.top_logprobs))

    def record(self, token_id: int) -> None:
        """Account a token appended to the output (penalty state)."""
        if self.output_counts is not None and 0 <= token_id < self.vocab_size:
            slot = self._output_slot.get(token_id)
            if slot is None:
                self._output_slot[token_id] = self.num_output
                self._output_ids = _appended(self._output_ids, self.num_output, token_id)
                self._output_id_counts = _appended(self._output_id_counts, self.num_output, 1)
                self.num_output += 1
            else:
                self._output_id_counts[slot] += 1
            self.output_counts[token_id] += 1
            if not self.seen_mask[token_id]:
                self.seen_mask[token_id] = True
                self._seen_ids = _appended(self._seen_ids, self.num_seen, token_id)
                self.num_seen += 1


def _appended(buf: np.ndarray, size: int, value: int) -> np.ndarray:
    """``buf`` with ``value`` at ``[size]``: the same array, or one twice as long when it is full."""
    if size == len(buf):
        buf = np.concatenate([buf, np.empty(max(16, size), dtype=buf.dtype)])
    buf[size] = value
    return buf


def needs_logits(samplers: Sequence[RequestSampler], masked_rows: Sequence[int] = ()) -> bool:
    """Whether ``sample_batch`` reads the logits, or a device's row summary (argmax, log-normalizer, the argmax's
    log-probability) is all it needs: every row plain greedy, none masked, no top alternatives asked for."""
    return bool(masked_rows) or not all(s.plain_greedy and s.params.top_logprobs == 0 and s.label_ids is None
                                        for s in samplers)


def sample_batch(logits: np.ndarray | None, samplers: Sequence[RequestSampler], bitmask: np.ndarray | None = None,
                 masked_rows: Sequence[int] = (),
                 summary: tuple[np.ndarray, ...] | None = None) -> list[SampleResult]:
    """Sample one token per row of ``logits`` (float32 ``[n, vocab]``), row i by ``samplers[i]``.

    An all-plain-greedy batch is one vectorized argmax; otherwise every sampled row is drawn in one
    vectorized pass (``engine.sampling_fast.draw_tokens``). Each sampler records its token.

    Args:
        bitmask: int32 ``[n, words]`` token masks of constrained decoding (see apply_token_bitmask), read
            only for ``masked_rows``; the other rows pay nothing.
        masked_rows: the rows whose mask applies.
        summary: the rows' argmax, log-normalizer ``log(sum(exp(logits)))`` and the argmax's log-probability as
            the device computed them (``engine.graph_capture.add_row_summary``), or None: an all-greedy batch
            then takes its tokens and log-probabilities (``logits[token] - normalizer``) from them instead of a
            pass over the logits, except when masked rows want log-probabilities (those are of the masked
            distribution). ``logits`` may be None where ``needs_logits`` says the summary is enough.

    NOTE(engine): the mask comes first, before logit_bias, the penalties and the greedy shortcut, so no
    transform can bring back a token the grammar forbids. Returned logprobs are those of the masked row
    (as vLLM's, whose grammar bitmask is applied before its sampler): forbidden tokens have probability 0
    and the rest are renormalized; temperature and penalties are not in them.
    """
    rows = list(masked_rows)
    if logits is None:  # NOTE(engine): an all-greedy step whose logits stayed on the device (``needs_logits``)
        if summary is None or needs_logits(samplers, rows):
            raise ValueError("no logits: a batch without them needs the device's row summary and plain greedy rows")
        tokens, token_logprobs = summary[0], summary[2]
        results = [SampleResult(int(t), TokenLogprob(int(t), float(lp)) if s.want_logprobs else None)
                   for s, t, lp in zip(samplers, tokens, token_logprobs)]
    elif all(s.plain_greedy for s in samplers):
        want = [i for i, s in enumerate(samplers) if s.want_logprobs]
        if rows and want:  # the masked rows' logprobs are those of the masked distribution
            logits = np.array(logits)  # NOTE(engine): a copy: the caller's logits stay as they were
            logits[rows] = apply_token_bitmask(logits[rows], bitmask[rows])
            rows, summary = [], None  # (the device's summary is of the unmasked rows)
        if summary is not None:
            tokens, top = np.array(summary[0], dtype=np.int64), summary[1]
            log_sum = np.zeros_like(top)  # (x - normalizer) - 0: the log-probability
        else:
            tokens, top, log_sum = greedy_pass(logits, normalizers=bool(want))
        for i in rows:
            # NOTE(engine): exact shortcut: when the grammar allows the row's own argmax, it is the masked
            # argmax too (first index on ties either way); only the other rows pay for the whole mask.
            if not token_allowed(bitmask[i], int(tokens[i])):
                tokens[i] = np.argmax(apply_token_bitmask(logits[i], bitmask[i]))
        logprobs: dict[int, TokenLogprob] = {}
        if want:
            logprobs = dict(zip(want, batch_logprobs(logits, tokens[want],
                                                     [samplers[i].params.top_logprobs for i in want],
                                                     top[want], log_sum[want], rows=want)))
        results = [SampleResult(int(t), logprobs.get(i)) for i, t in enumerate(tokens)]
    else:
        if rows:
            logits = np.array(logits)  # NOTE(engine): a copy: the caller's logits stay as they were
            logits[rows] = apply_token_bitmask(logits[rows], bitmask[rows])
        results = _sample_rows(logits, samplers)
    for i, s in enumerate(samplers):
        if s.label_ids is not None and logits is not None:  # NOTE(engine): needs_logits keeps them on the host
            results[i] = SampleResult(results[i].token_id, label_logprobs(logits[i], results[i].token_id, s.label_ids))
    for s, r in zip(samplers, results):
        if s.output_counts is not None:
            s.record(r.token_id)
    return results


def _sample_rows(logits: np.ndarray, samplers: Sequence[RequestSampler]) -> list[SampleResult]:
    """The tokens of ``samplers`` (row i by ``samplers[i]``) from float32 ``[n, vocab]`` logits (masks applied).

    NOTE(engine): rows are independent: each one's token depends on its own logits, params and rng only,
    so a request gets the same token alone or in any batch. One rng draw per sampled row, in row order.
    """
    n = len(samplers)
    edits = _edits(logits, samplers)  # logit_bias and the penalties, as sparse edits of the logits
    tokens = np.empty(n, dtype=np.int64)
    greedy = np.array([s.greedy for s in samplers])
    if greedy.any():
        rows = np.flatnonzero(greedy)
        chosen = logits[rows]  # a copy: the edits go into it
        if edits is not None:
            e_row, e_col, e_val = _edits_of(edits, rows)
            chosen[e_row, e_col] = e_val
        tokens[rows] = np.argmax(chosen, axis=-1)
    if not greedy.all():
        drawn = np.flatnonzero(~greedy)
        params = [samplers[i].params for i in drawn]
        u = np.array([samplers[i].rng.random() for i in drawn])
        sub = logits if len(drawn) == n else logits[drawn]
        filters = any(samplers[i].use_filters for i in drawn)
        tokens[drawn] = draw_tokens(
            sub, u, temperature=np.array([q.temperature for q in params]),
            # NOTE(engine): a top_k beyond the vocabulary keeps it all (and may not fit an int64: a fuzzed 10**30)
            top_k=np.array([min(q.top_k, sub.shape[-1]) for q in params]) if filters else None,
            top_p=np.array([q.top_p for q in params]) if filters else None,
            min_p=np.array([q.min_p for q in params]) if filters else None,
            edits=edits if edits is None or len(drawn) == n else _edits_of(edits, drawn))
    return [SampleResult(int(t), s.logprob_of(logits[i], int(t)) if s.want_logprobs else None)
            for i, (s, t) in enumerate(zip(samplers, tokens))]


def _edits(logits: np.ndarray, samplers: Sequence[RequestSampler]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``RequestSampler.process``'s first two steps (logit_bias, then the repetition, presence and frequency
    penalties) for every row of float32 ``[n, vocab]`` logits at once, on the tokens they touch only:
    ``(rows, cols, values)``, the new float32 values of ``logits[rows, cols]``, rows ascending, each
    ``(row, col)`` once; None when no row has any.

    NOTE(engine): every value goes through the reference's float32 operations in its order (float32 adds of
    the bias, ``x / r`` or ``x * r`` with r in float32, minus the float64 penalty rounded to float32), so the
    edited row is ``process``'s, bit for bit; the per-row work is gathering each sampler's id arrays.
    """
    fix = [i for i, s in enumerate(samplers) if s.needs_adjust]
    if not fix:
        return None
    vocab = logits.shape[1]
    empty = np.empty(0, dtype=np.int64)

    def keyed(rows: list[int], ids: list[np.ndarray]) -> np.ndarray:  # flat keys row * vocab + id
        if not rows:
            return empty
        return np.concatenate(ids) + np.repeat(np.array(rows, dtype=np.int64) * vocab, [len(a) for a in ids])

    biased = [i for i in fix if len(samplers[i].bias_ids)]
    repeated = [i for i in fix if samplers[i].params.repetition_penalty != 1.0 and samplers[i].num_seen]
    penalized = [i for i in fix if (samplers[i].params.presence_penalty != 0.0
                                    or samplers[i].params.frequency_penalty != 0.0) and samplers[i].num_output]
    bias_keys = keyed(biased, [samplers[i].bias_ids for i in biased])
    seen_keys = keyed(repeated, [samplers[i]._seen_ids[:samplers[i].num_seen] for i in repeated])
    out_keys = keyed(penalized, [samplers[i]._output_ids[:samplers[i].num_output] for i in penalized])
    sources = [a for a in (bias_keys, seen_keys, out_keys) if len(a)]
    if not sources:
        return None
    unique_bias = all(samplers[i].bias_unique for i in biased)
    if len(sources) == 1 and (sources[0] is not bias_keys or unique_bias):  # by row, each id once: as they are
        keys = sources[0]

        def places(a: np.ndarray) -> np.ndarray:
            return np.arange(len(a))
    else:  # a logit_bias may name an id twice (np.add.at below), and ids of several sources meet
        keys = np.unique(np.concatenate(sources))

        def places(a: np.ndarray) -> np.ndarray:
            return np.searchsorted(keys, a)
    rows, cols = np.divmod(keys, vocab)
    values = logits[rows, cols]  # float32
    if len(bias_keys):
        bias = np.concatenate([samplers[i].bias_values for i in biased])
        np.add.at(values, places(bias_keys), bias)
    if len(seen_keys):
        at = places(seen_keys)
        r = np.repeat(np.array([samplers[i].params.repetition_penalty for i in repeated], dtype=np.float32),
                      [samplers[i].num_seen for i in repeated])
        v = values[at]
        values[at] = np.where(v > 0, v / r, v * r)
    if len(out_keys):
        at = places(out_keys)
        sizes = [samplers[i].num_output for i in penalized]
        counts = np.concatenate([samplers[i]._output_id_counts[:samplers[i].num_output] for i in penalized])
        frequency = np.repeat([samplers[i].params.frequency_penalty for i in penalized], sizes)
        presence = np.repeat([samplers[i].params.presence_penalty for i in penalized], sizes)
        values[at] -= (frequency * counts + presence * (counts > 0)).astype(np.float32)
    return rows, cols, values


def _edits_of(edits: tuple[np.ndarray, np.ndarray, np.ndarray],
              rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The edits of ``rows`` (ascending), renumbered to their places in ``rows``."""
    e_row, e_col, e_val = edits
    at = np.minimum(np.searchsorted(rows, e_row), len(rows) - 1)
    mine = rows[at] == e_row
    return at[mine], e_col[mine], e_val[mine]
