"""The bench's prompts against the real default model's tokenizer (SmolLM2, byte-level BPE): N words are
N tokens, and the model's chat template adds a fixed overhead that the server reports in usage."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer

from bench.scenarios import COMMON_WORDS, index_words, make_prompt


def test_prompt_lengths_in_smollm2_tokens(default_model: Path):
    tok = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    # Every word is one token after a space (what makes N words about N tokens).
    assert all(len(encode(" " + w)) == 1 for w in COMMON_WORDS)
    for n in (1, 16, 128, 512, 2000):
        prompt = make_prompt(n, random.Random(n), prefix_words=index_words(n))
        assert len(encode(prompt)) == n
        assert len(encode(make_prompt(n, random.Random(n), encode=encode))) == n
