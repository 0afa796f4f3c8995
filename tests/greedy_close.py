"""The suite's one rule for comparing greedy output produced on two paths that may round differently.

Which paths round differently: MatMulNBits at accuracy level 4 quantises activations to int8, and the kernel it
runs depends on the CPU (AVX-512 VNNI, AVX-512, AVX2) and on the number of rows. Measured with one MatMulNBits
node (K=576, N=1536) on the 2-core machines: on AVX-512 VNNI every row count gives bit-identical rows; under AVX2
(qemu's EPYC-Rome model) a lone row (M=1, a single decode step) differs from the same row among others (M >= 2),
while every M >= 2 agrees. So greedy text is exact on every CPU only where both sides run the same row counts:
the same request run twice with the same batch shape, or one row beside another one-row decoder. Anything else
(alone against batched, one process against another that batches differently, drafts on against off, prefix
reuse against cold, CPU against GPU) is compared with ``assert_greedy_close``.

The rule is vLLM's ``check_logprobs_close`` with a stated bound:
- the two token sequences must agree up to their first difference;
- there each side's token must be in the other side's top-k, and on each side the log-probabilities of the two
  tokens may differ by less than ``max_gap`` nats: a near-tie, which kernels may break either way;
- after that position nothing is compared (the contexts differ from there on).

Usage::

    ref = GreedyRun.from_engine(outputs_alone)               # engine RequestOutputs with logprobs=True, top_logprobs=5
    got = GreedyRun.from_openai(response.choices[0].logprobs)  # or an OpenAI chat choice's logprobs
    assert_greedy_close(ref, got)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# NOTE(tests): nats. Rounding differences between row counts or CPU kernels move SmolLM2's INT4 logits by up to
# ~0.5 (tests/integration/engine/test_default_model.py); two tokens closer than this may swap on another path.
MAX_GAP_NATS = 0.5
TOP_K = 5  # how many alternatives each side asks for (logprobs' top_logprobs)


@dataclass(frozen=True)
class GreedyRun:
    """One greedy sequence with each step's top-k: ``tokens[i]`` was chosen where ``top[i]`` maps token ->
    log-probability. Tokens are ids (engine) or strings (the OpenAI API); ``ended`` marks a stop at the end
    (EOS or a stop string) rather than a length cut."""

    tokens: tuple[Hashable, ...]
    top: tuple[dict[Hashable, float], ...]
    ended: bool = False

    @classmethod
    def from_engine(cls, outputs: Iterable[Any], index: int = 0) -> "GreedyRun":
        """From ``AsyncEngine.generate()``'s outputs of one choice (SamplingParams(logprobs=True, top_logprobs=k))."""
        tokens: list[int] = []
        top: list[dict[Hashable, float]] = []
        ended = False
        for out in outputs:
            if out.index != index:
                continue
            tokens += out.token_ids
            top += [dict(lp.top) | {lp.token_id: lp.logprob} for lp in (out.logprobs or ())]
            if out.finish_reason is not None:
                ended = out.finish_reason.value == "stop"
        if len(top) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(top)} logprobs: ask for logprobs=True, top_logprobs=k")
        return cls(tuple(tokens), tuple(top), ended)

    @classmethod
    def from_openai(cls, logprobs: Any, finish_reason: str | None = None) -> "GreedyRun":
        """From an OpenAI choice's ``logprobs`` (an SDK object or its JSON dict; ``content`` entries with
        ``token``, ``logprob`` and ``top_logprobs``)."""
        content = logprobs["content"] if isinstance(logprobs, dict) else logprobs.content
        tokens: list[str] = []
        top: list[dict[Hashable, float]] = []
        for entry in content or ():
            entry = entry if isinstance(entry, dict) else entry.model_dump()
            tokens.append(entry["token"])
            top.append({alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]} | {entry["token"]: entry["logprob"]})
        return cls(tuple(tokens), tuple(top), finish_reason == "stop")


@dataclass(frozen=True)
class Divergence:
    """Where two greedy runs part: position, each side's token there, and each side's gap between the two."""

    position: int
    ref_token: Hashable
    got_token: Hashable
    ref_gap: float  # ref's logprob(ref_token) - logprob(got_token); inf where got_token is not in ref's top-k
    got_gap: float  # got's logprob(got_token) - logprob(ref_token); inf likewise

    def is_near_tie(self, max_gap: float) -> bool:
        return self.ref_gap < max_gap and self.got_gap < max_gap

    def describe(self, ref: GreedyRun, got: GreedyRun) -> str:
        return (f"position {self.position}: {self.ref_token!r} (ref) vs {self.got_token!r} (got); gap "
                f"{self.ref_gap:.3f} nats on ref's side, {self.got_gap:.3f} on got's; ref top "
                f"{_top(ref, self.position)}, got top {_top(got, self.position)}; agreed prefix "
                f"{list(ref.tokens[:self.position][-8:])!r}")


END = "<end of sequence>"  # the token a run that stopped "chose" after its last one (see first_divergence)


def first_divergence(ref: GreedyRun, got: GreedyRun) -> Divergence | None:
    """The first position where ``ref`` and ``got`` differ, or None if they agree wherever both have tokens.

    A run that stopped (``ended``) where the other goes on counts as choosing END there: a near-tie only where
    the other side's top-k at that step holds an end it was close to (which the OpenAI API does not report, so
    such a case is never a near-tie there)."""
    n = min(len(ref.tokens), len(got.tokens))
    i = next((i for i in range(n) if ref.tokens[i] != got.tokens[i]), n)
    if i == n:
        if len(ref.tokens) == len(got.tokens) or not (ref.ended if len(ref.tokens) == n else got.ended):
            return None  # equal, or the shorter one was cut by length
        ref_token = ref.tokens[i] if i < len(ref.tokens) else END
        got_token = got.tokens[i] if i < len(got.tokens) else END
    else:
        ref_token, got_token = ref.tokens[i], got.tokens[i]
    return Divergence(i, ref_token, got_token, _gap(ref, i, ref_token, got_token), _gap(got, i, got_token, ref_token))


def assert_greedy_close(ref: GreedyRun, got: GreedyRun, max_gap: float = MAX_GAP_NATS, what: str = "") -> Divergence | None:
    """Fail unless ``got`` equals ``ref`` up to a first difference that is a near-tie (see the module docstring).

    Returns the divergence (None when equal), so a test can report or count them."""
    div = first_divergence(ref, got)
    if div is not None and not div.is_near_tie(max_gap):
        raise AssertionError(f"{what or 'greedy runs'} part at a choice that is not a near-tie (bound {max_gap} "
                             f"nats): {div.describe(ref, got)}")
    return div


def assert_decided(run: GreedyRun, num_tokens: int, min_gap: float = MAX_GAP_NATS, what: str = "") -> float:
    """A precondition that holds on every CPU: each of the first ``num_tokens`` greedy choices of ``run`` beat the
    runner-up by at least ``min_gap`` nats, so no kernel's rounding can pick another token there. Needs
    ``top_logprobs >= 2``. Returns the narrowest margin; fails naming it where it is too narrow."""
    if num_tokens > len(run.tokens):
        raise AssertionError(f"{what or 'the precondition'}: {num_tokens} tokens asked for, the run has {len(run.tokens)}")
    margins = []
    for i in range(num_tokens):
        others = [lp for t, lp in run.top[i].items() if t != run.tokens[i]]
        if not others:
            raise AssertionError(f"position {i}: no runner-up in the top-k; ask for top_logprobs >= 2")
        margins.append(run.top[i][run.tokens[i]] - max(others))
    i = min(range(num_tokens), key=margins.__getitem__)
    if margins[i] < min_gap:
        raise AssertionError(f"{what or 'the precondition'} is not decided on every CPU: at position {i} the greedy "
                             f"choice {run.tokens[i]!r} beats the runner-up by {margins[i]:.3f} nats (< {min_gap}); "
                             f"top {_top(run, i)}; choose a prompt with a wider margin")
    return margins[i]


def _gap(run: GreedyRun, i: int, chosen: Hashable, other: Hashable) -> float:
    if i >= len(run.top):
        return float("inf")
    top = run.top[i]
    if chosen not in top or other not in top:
        return float("inf")
    return top[chosen] - top[other]


def _top(run: GreedyRun, i: int) -> Sequence[tuple[Hashable, float]]:
    if i >= len(run.top):
        return ()
    return [(t, round(lp, 3)) for t, lp in sorted(run.top[i].items(), key=lambda kv: -kv[1])]
