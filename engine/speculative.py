"""Prompt-lookup drafts for speculative decoding: an n-gram index over one request's tokens, and the
adaptive draft length that backs off when drafts are rejected.

Pure Python (the scheduler asks for drafts; the sampler verifies them: RequestSampler.verify); no numpy,
no onnxruntime.

NOTE(engine): prompt lookup decoding (Saxena 2023; vLLM's "ngram" proposer, transformers'
``prompt_lookup_num_tokens``): the last few tokens are looked up among the earlier ones (prompt and output),
and what followed them there is the draft. The model checks the last token and the draft in one run and
keeps the longest prefix it agrees with, plus its own next token. It pays when answers copy their input
(code edits, rewrites, quotes, extraction) and costs one slightly longer run per rejected draft otherwise;
the back-off below keeps that cost small on free text.
"""

from __future__ import annotations

from collections.abc import Sequence

# n-gram sizes tried, longest first: a longer match predicts better; 1-grams (a single common token such as
# " the") match almost everywhere and draft noise.
MAX_NGRAM = 3
MIN_NGRAM = 2
# After a draft with no token accepted the request drafts nothing for 1, 3, 7, ... steps (capped): on free
# text a lookup often matches something the model doesn't continue, and each such verify run costs more
# than the plain decode step it replaces.
MAX_SKIP_STEPS = 32
# NOTE(engine): a check of S tokens costs about 1 + CHECK_COST_PER_TOKEN * (S - 1) decode steps (measured on
# SmolLM2-135M INT4, 2 cores: 1.29x at S = 2, 1.75x at 4, 2.82x at 8, 4.5x at 16). With a per-token acceptance
# rate a, a draft of d tokens yields 1 + a + a^2 + ... + a^d tokens per check; the draft length is the d that
# maximizes tokens per decode step's worth of time, and 0 (no draft) unless that beats plain decoding by
# MIN_GAIN. a is estimated from the request's own checks, starting from PRIOR (accepted, tested): a fresh
# request drafts 1 token, and the length grows as its drafts keep being accepted (copied text: up to
# max_tokens), or stays short where they aren't (free text).
CHECK_COST_PER_TOKEN = 0.25
MIN_GAIN = 0.05
PRIOR = (0.5, 1.0)
DECAY = 0.8  # weight of earlier checks against the newest one
MEMORY_TOKENS = 16.0  # the estimate remembers about this many tested tokens (it follows the text as it changes)


class NgramDrafter:
    """Drafts for one request from its own tokens; owned by the scheduler (core thread only).

    Usage::

        drafter = NgramDrafter(max_tokens=16)
        draft = drafter.propose(request.prompt_ids, request.output_ids, limit=remaining)
        ...  # verify; n of the len(draft) tokens were accepted
        drafter.record(len(draft), n)

    Args:
        max_tokens: the most tokens one draft holds (``--speculative-tokens``).
        min_ngram / max_ngram: n-gram sizes looked up (longest first).
        prior: (accepted, tested) token counts the acceptance rate starts from.
    """

    def __init__(self, max_tokens: int, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM,
                 prior: tuple[float, float] = PRIOR) -> None:
        if max_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need max_tokens >= 1 and 1 <= min_ngram <= max_ngram, got {max_tokens}, "
                             f"{min_ngram}, {max_ngram}")
        self.max_tokens = max_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.num_drafted = 0
        self.num_accepted = 0
        self._prior = prior  # (accepted, tested) before any check
        self._accepted, self._tested = prior  # decayed counts behind the acceptance rate
        self._tokens: list[int] = []
        self._num_output = 0  # output tokens already copied into _tokens
        # n-gram -> the index of the token that followed its latest occurrence (whose continuation exists)
        self._next: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # _tokens[:_num_indexed] have their preceding n-grams indexed
        self._skip = 0
        self._misses = 0

    @property
    def acceptance_rate(self) -> float:
        """The estimated chance that the next draft token is accepted (given the ones before it were)."""
        return self._accepted / self._tested

    @property
    def num_tokens(self) -> int:
        """The draft length the acceptance rate pays for now (0: none)."""
        return best_draft_length(self.acceptance_rate, self.max_tokens)

    def propose(self, prompt_ids: Sequence[int], output_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """A draft of at most ``min(limit, num_tokens)`` tokens to follow ``prompt_ids + output_ids``, or ()."""
        if not self._tokens:
            self._tokens = list(prompt_ids)
        if len(output_ids) > self._num_output:
            self._tokens.extend(output_ids[self._num_output:])
            self._num_output = len(output_ids)
        self._index()
        if self._skip > 0:
            self._skip -= 1
            return ()
        limit = min(limit, self.num_tokens)
        if limit <= 0:
            # NOTE(engine): drift back to the prior, so a request whose drafts failed tries again later
            self._accepted = DECAY * self._accepted + (1 - DECAY) * self._prior[0]
            self._tested = DECAY * self._tested + (1 - DECAY) * self._prior[1]
            return ()
        tokens = self._tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is not None:
                draft = tokens[start:start + limit]
                # NOTE(engine): a match near the end (a loop: "a b c a b c") runs into the draft itself
                while len(draft) < limit:
                    draft.append(draft[start + len(draft) - len(tokens)])
                return tuple(draft)
        return ()

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Learn from a check: ``num_accepted`` of ``num_drafted`` tokens kept. The first rejected token (if any)
        counts as tested; a check with nothing accepted also pauses drafting for 1, 3, 7, ... steps."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        tested = num_accepted + (num_accepted < num_drafted)
        self._accepted = DECAY * self._accepted + num_accepted
        self._tested = DECAY * self._tested + tested
        if self._tested > MEMORY_TOKENS:
            self._accepted *= MEMORY_TOKENS / self._tested
            self._tested = MEMORY_TOKENS
        if num_accepted == 0:
            self._misses += 1
            self._skip = min(2 ** self._misses - 1, MAX_SKIP_STEPS)
        else:
            self._misses = 0

    def _index(self) -> None:
        """Index the n-grams that end just before each token not yet indexed (their continuation)."""
        tokens = self._tokens
        for i in range(max(self._num_indexed, self.min_ngram), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                self._next[tuple(tokens[i - n:i])] = i
        self._num_indexed = len(tokens)


def best_draft_length(acceptance_rate: float, max_tokens: int) -> int:
    """The draft length d in [1, max_tokens] with the most expected tokens per decode step's worth of time,
    ``(1 + a + ... + a^d) / (1 + CHECK_COST_PER_TOKEN * d)``; 0 when even the best doesn't beat 1 + MIN_GAIN."""
    best, best_gain = 0, 1.0 + MIN_GAIN
    expected, power = 1.0, 1.0
    for d in range(1, max_tokens + 1):
        power *= acceptance_rate
        expected += power
        gain = expected / (1.0 + CHECK_COST_PER_TOKEN * d)
        if gain > best_gain:
            best, best_gain = d, gain
    return best
