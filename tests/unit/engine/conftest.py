"""Fixtures for engine unit tests: a real byte-level BPE tokenizer trained in-process (no download)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "Hello world, hello there! The quick brown fox jumps over the lazy dog.",
    "Stop strings like END and ### must never leak into the stream.",
    "日本語のテキストと中文文本 mixed with English words.",
    "Emoji: 😀 🚀 👍🏽 and accents: café naïve résumé.",
    "def main():\n    return 42\n\n",
] * 20

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="session")
def bpe_tokenizer() -> Tokenizer:
    """Byte-level BPE (GPT-2 style) with ChatML specials as ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok
