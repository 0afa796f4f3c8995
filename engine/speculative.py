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
# A request's first draft holds at most this many tokens; each fully accepted draft doubles the length up to
# max_tokens. A wrong first draft then costs a short check, not a max-length one (~4.5 decode steps at 17).
INITIAL_DRAFT_TOKENS = 4


class NgramDrafter:
    """Drafts for one request from its own tokens; owned by the scheduler (core thread only).

    Usage::

        drafter = NgramDrafter(max_tokens=8)
        draft = drafter.propose(request.prompt_ids, request.output_ids, limit=remaining)
        ...  # verify; n of the len(draft) tokens were accepted
        drafter.record(len(draft), n)

    Args:
        max_tokens: the most tokens one draft holds (``--speculative-tokens``).
        min_ngram / max_ngram: n-gram sizes looked up (longest first).
    """

    def __init__(self, max_tokens: int, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM) -> None:
        if max_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need max_tokens >= 1 and 1 <= min_ngram <= max_ngram, got {max_tokens}, "
                             f"{min_ngram}, {max_ngram}")
        self.max_tokens = max_tokens
        self.num_tokens = min(max_tokens, INITIAL_DRAFT_TOKENS)  # the current draft length (adapts)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.num_drafted = 0
        self.num_accepted = 0
        self._tokens: list[int] = []
        self._num_output = 0  # output tokens already copied into _tokens
        # n-gram -> the index of the token that followed its latest occurrence (whose continuation exists)
        self._next: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # _tokens[:_num_indexed] have their preceding n-grams indexed
        self._skip = 0
        self._misses = 0

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
        """Adapt to a verify run's outcome: grow after a fully accepted draft, shrink to what was accepted
        (plus one) otherwise, and skip the next steps after a draft the model rejected outright."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if num_accepted >= num_drafted:
            self.num_tokens = min(self.max_tokens, 2 * self.num_tokens)
        else:
            self.num_tokens = max(1, num_accepted + 1)
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
