"""Request mixes for the bench: prompts of controlled token length and output-length choices.

Pure Python (no onnxruntime, no HTTP); the load generator and the engine-direct driver both consume it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# NOTE(bench): every word below is one token with its leading space in GPT-2-style byte-level BPE
# vocabularies (checked against SmolLM2's 49152-token vocabulary: all of them are single "Ġword"
# tokens), so a prompt of N space-separated words is about N tokens; the server's usage.prompt_tokens
# is recorded next to the target so the difference is visible.
COMMON_WORDS: tuple[str, ...] = tuple(
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there one all we their has been would will more if no when its who "
    "so than into time only some could them other new these two may then first any like now my over "
    "such our man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three".split()
)

SCENARIOS = ("fixed", "soak", "json_schema")

# Soak mix: (prompt length, output length) as multiples of the requested --prompt-tokens/--output-tokens,
# drawn uniformly; short and long requests interleave so slots are freed and reused at varied lengths.
_SOAK_PROMPT_SCALES = (0.125, 0.25, 0.5, 1.0, 2.0)
_SOAK_OUTPUT_SCALES = (0.125, 0.25, 0.5, 1.0)


# NOTE(bench): every item of the json_schema scenario's array is at least 8 tokens of compact JSON
# ({"id":N,"name":"","tags":[],"active":true} alone is more), so minItems = ceil(max_tokens / 8) keeps the
# grammar from completing before max_tokens: every constrained request yields exactly max_tokens tokens, like
# the unconstrained ones with ignore_eos, and time per output token compares like for like.
_MIN_TOKENS_PER_ITEM = 8


def json_schema_for(max_tokens: int) -> dict:
    """A typical API-style schema (objects, required, additionalProperties false, enum, bounded strings and
    integers, a nullable field, $defs/$ref) whose answer runs at least ``max_tokens`` tokens."""
    return {
        "$defs": {"record": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
                "name": {"type": "string", "maxLength": 24},
                "tags": {"type": "array", "items": {"enum": ["new", "used", "sale", "rare"]}, "maxItems": 3},
                "active": {"type": "boolean"},
                "note": {"type": ["string", "null"], "maxLength": 40},
            },
            "required": ["id", "name", "tags", "active", "note"],
            "additionalProperties": False,
        }},
        "type": "object",
        "properties": {"records": {"type": "array", "items": {"$ref": "#/$defs/record"},
                                   "minItems": -(-max_tokens // _MIN_TOKENS_PER_ITEM)}},
        "required": ["records"],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class RequestSpec:
    """One request the bench will send.

    Attributes:
        index: position in the run, 0-based (also the request id suffix).
        prompt: the user text (chat) or the whole prompt (completions).
        num_prompt_tokens_target: the token count the prompt was built for (before any chat template).
        max_tokens: output tokens asked for (sent as max_tokens and min_tokens, with ignore_eos).
        json_schema: the json_schema scenario's schema (sent as response_format), else None.
    """

    index: int
    prompt: str
    num_prompt_tokens_target: int
    max_tokens: int
    json_schema: dict | None = None


def make_prompt(num_tokens: int, rng: random.Random, *, encode: Callable[[str], list[int]] | None = None,
                prefix_words: tuple[str, ...] = ()) -> str:
    """Build a prompt of about ``num_tokens`` tokens from common words.

    Args:
        num_tokens: target length in tokens (>= 1).
        rng: word choice (seeded by the caller, so runs are reproducible).
        encode: optional tokenizer (text -> token ids); with it the prompt is the longest word sequence
            that encodes to at most ``num_tokens`` ids (exactly that many when words are single tokens).
        prefix_words: words put first (see index_words), so prompts differ from their first token and no
            prefix cache can share them; counted in the length.

    Returns:
        The prompt text.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens!r}")
    words = list(prefix_words[:num_tokens])
    while len(words) < num_tokens:
        words.append(rng.choice(COMMON_WORDS))
    if encode is None:
        return " ".join(words)
    # NOTE(bench): grow until the text reaches the target, then shrink to the longest prompt that does not
    # exceed it: exact when words are one token each (bounded, in case words merge or split).
    for _ in range(4 * num_tokens):
        if len(encode(" ".join(words))) >= num_tokens:
            break
        words.append(rng.choice(COMMON_WORDS))
    while len(words) > 1 and len(encode(" ".join(words))) > num_tokens:
        words.pop()
    return " ".join(words)


def index_words(index: int) -> tuple[str, ...]:
    """Spell a non-negative integer in base len(COMMON_WORDS), one word (one token) per digit."""
    base, digits = len(COMMON_WORDS), []
    while True:
        index, digit = divmod(index, base)
        digits.append(COMMON_WORDS[digit])
        if index == 0:
            return tuple(reversed(digits))


def iter_requests(scenario: str, num_requests: int, prompt_tokens: int, output_tokens: int, *, seed: int = 0,
                  encode: Callable[[str], list[int]] | None = None) -> Iterator[RequestSpec]:
    """Yield the requests of one run, lazily (a 10,000-request soak does not hold every prompt).

    Args:
        scenario: "fixed" (every request has prompt_tokens in, output_tokens out), "soak" (mixed lengths
            around those two numbers, see _SOAK_*_SCALES) or "json_schema" (as fixed, every answer constrained
            to json_schema_for(output_tokens): structured outputs at the same token counts).
        num_requests: how many to yield.
        prompt_tokens: prompt length in tokens (the mean scale for soak).
        output_tokens: output length in tokens (the maximum for soak).
        seed: RNG seed; the same arguments always give the same prompts.
        encode: optional tokenizer for exact prompt lengths (see make_prompt).

    Yields:
        RequestSpec, index 0..num_requests-1.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
    rng = random.Random(seed)
    for index in range(num_requests):
        if scenario == "soak":
            p = max(1, round(prompt_tokens * rng.choice(_SOAK_PROMPT_SCALES)))
            o = max(1, round(output_tokens * rng.choice(_SOAK_OUTPUT_SCALES)))
        else:
            p, o = prompt_tokens, output_tokens
        # NOTE(bench): the request number, spelled in words, leads, so two prompts never share a prefix.
        prompt = make_prompt(p, rng, encode=encode, prefix_words=index_words(index))
        schema = json_schema_for(o) if scenario == "json_schema" else None
        yield RequestSpec(index=index, prompt=prompt, num_prompt_tokens_target=p, max_tokens=o, json_schema=schema)


def poisson_offsets_s(rate_per_s: float, num_requests: int, *, seed: int = 0) -> list[float]:
    """Arrival times of an open-loop (Poisson) run: cumulative exponential gaps.

    Args:
        rate_per_s: mean arrivals per second (> 0).
        num_requests: how many arrivals.
        seed: RNG seed.

    Returns:
        ``num_requests`` offsets in seconds from the run start, non-decreasing, the first one 0.0.
    """
    if rate_per_s <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate_per_s!r}")
    rng = random.Random(seed + 7919)
    offsets, t = [], 0.0
    for i in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(rate_per_s)
    return offsets
