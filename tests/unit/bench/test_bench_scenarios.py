"""bench.scenarios: prompt lengths in tokens of a real byte-level BPE, request mixes, Poisson arrivals."""

from __future__ import annotations

import random
import statistics

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.scenarios import COMMON_WORDS, index_words, iter_requests, json_schema_for, make_prompt, poisson_offsets_s


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A real byte-level BPE (GPT-2 pre-tokenizer) trained here on plain English-like text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(COMMON_WORDS) for _ in range(40)) for _ in range(400)]
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def test_prompt_has_the_requested_number_of_words_and_is_reproducible():
    a = make_prompt(50, random.Random(1))
    assert len(a.split()) == 50 and all(w in COMMON_WORDS for w in a.split())
    assert a == make_prompt(50, random.Random(1)) != make_prompt(50, random.Random(2))


def test_prompt_is_about_n_tokens_for_a_byte_level_bpe(bpe):
    for n in (1, 8, 128, 512):
        ids = bpe.encode(make_prompt(n, random.Random(n))).ids
        assert abs(len(ids) - n) <= 1  # only the first word has no leading space


def test_prompt_is_exact_with_a_tokenizer(bpe):
    encode = lambda text: bpe.encode(text).ids  # noqa: E731
    for n in (1, 7, 100):
        assert len(encode(make_prompt(n, random.Random(n), encode=encode))) == n


def test_index_words_are_unique_single_words():
    seen = {index_words(i) for i in range(20_000)}
    assert len(seen) == 20_000
    assert index_words(0) == (COMMON_WORDS[0],) and index_words(len(COMMON_WORDS)) == (COMMON_WORDS[1], COMMON_WORDS[0])


def test_fixed_scenario():
    specs = list(iter_requests("fixed", 5, 16, 32, seed=4))
    assert [s.index for s in specs] == list(range(5))
    assert all(s.max_tokens == 32 and s.num_prompt_tokens_target == 16 and len(s.prompt.split()) == 16
               for s in specs)
    firsts = [s.prompt.split()[0] for s in specs]
    assert len(set(firsts)) == 5  # distinct leading word: no shared prefix
    assert specs == list(iter_requests("fixed", 5, 16, 32, seed=4))


def test_soak_scenario_mixes_lengths_within_bounds():
    specs = list(iter_requests("soak", 200, 64, 32, seed=0))
    prompt_lengths = {s.num_prompt_tokens_target for s in specs}
    output_lengths = {s.max_tokens for s in specs}
    assert prompt_lengths == {8, 16, 32, 64, 128}
    assert output_lengths == {4, 8, 16, 32}
    assert all(len(s.prompt.split()) == s.num_prompt_tokens_target for s in specs)


def test_json_schema_scenario_cannot_complete_before_max_tokens(bpe):
    import json

    import jsonschema

    specs = list(iter_requests("json_schema", 3, 16, 128, seed=1))
    assert all(s.max_tokens == 128 and s.json_schema == json_schema_for(128) for s in specs)
    assert [s.prompt for s in specs] == [s.prompt for s in iter_requests("fixed", 3, 16, 128, seed=1)]
    assert all(s.json_schema is None for s in iter_requests("fixed", 2, 8, 8))
    # the shortest item the schema allows is at least 8 tokens, so minItems items take >= max_tokens tokens
    schema = json_schema_for(128)
    shortest = {"id": 0, "name": "", "tags": [], "active": True, "note": None}
    assert len(bpe.encode(json.dumps(shortest, separators=(",", ":"))).ids) >= 8
    minimal = {"records": [shortest] * schema["properties"]["records"]["minItems"]}
    jsonschema.validate(minimal, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"records": minimal["records"][1:]}, schema)
    assert schema["properties"]["records"]["minItems"] * 8 >= 128


def test_unknown_scenario_and_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="scenario"):
        next(iter_requests("burst", 1, 8, 8))
    with pytest.raises(ValueError, match="num_tokens"):
        make_prompt(0, random.Random(0))
    with pytest.raises(ValueError, match="rate"):
        poisson_offsets_s(0.0, 3)


def test_poisson_offsets_have_the_requested_mean_rate():
    offsets = poisson_offsets_s(5.0, 20_000, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and min(gaps) >= 0.0
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.05)
    assert offsets[:5] == poisson_offsets_s(5.0, 5, seed=1)
