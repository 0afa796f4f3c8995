"""The synthetic tokenizer (exact vocab size, ChatML specials, lossless round trip) and model_cache_dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.builder import model_cache_dir
from engine.builder.tokenizer import synthetic_tokenizer, synthetic_vocab

TEXTS = ["", "hello world", "<|im_start|>user\nHi 123<|im_end|>\n", "naïve 漢字 🎉\t\t  x  ", "<|endoftext|>"]


@pytest.mark.parametrize("vocab_size", [259, 512, 5000])
def test_synthetic_vocab_has_exact_size_and_roundtrips(vocab_size):
    tok, special = synthetic_tokenizer(vocab_size)
    assert tok.get_vocab_size() == vocab_size
    assert (special.bos_id, special.eos_id, special.pad_id) == (1, 2, 2)
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert max(ids, default=0) < vocab_size
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>").ids == [1]


def test_every_id_decodes_and_merges_shorten_text():
    tok, _ = synthetic_tokenizer(1000)
    assert all(tok.id_to_token(i) is not None for i in range(1000))
    assert len(tok.encode("the tea is hot").ids) < len("the tea is hot")


def test_synthetic_vocab_rejects_too_small():
    with pytest.raises(ValueError, match="vocab_size must be >= 259"):
        synthetic_vocab(100)


def test_model_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("ORTSERVE_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("ORTSERVE_CACHE_DIR")
    assert model_cache_dir() == tmp_path / "xdg" / "ortserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache_dir() == Path(tmp_path / "home" / ".cache" / "ortserve")
