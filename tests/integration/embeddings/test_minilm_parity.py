"""all-MiniLM-L6-v2 converted by our builder, run by the embedding engine, against two references on the same
206-text corpus (empty strings, texts at the 256-token window and past it, non-ASCII text): an independent
float64 numpy BERT (computed here, from the package's own folder) and sentence-transformers' vectors (computed
once with torch by make_reference.py and committed). Target: cosine >= 0.9999 for every text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.embedding import EmbeddingConfig, EmbeddingEngine
from tests.integration.embeddings.bert_reference import BertReference
from tests.integration.embeddings.conftest import DATA

MIN_COSINE = 0.9999


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def engine_vectors(minilm_model: Path, corpus: list[str]) -> tuple[list[list[int]], np.ndarray]:
    engine = EmbeddingEngine.from_model_dir(minilm_model, EmbeddingConfig(nice=0))
    try:
        # texts past the window are truncated to it, as sentence-transformers does
        ids = engine.check(engine.tokenize(corpus, truncate_to=engine.max_seq_length))
        return ids, np.stack(engine.embed_sync(ids))
    finally:
        engine.shutdown()


def test_corpus_covers_the_cases(corpus: list[str], engine_vectors) -> None:
    ids, _ = engine_vectors
    lengths = [len(i) for i in ids]
    assert len(corpus) >= 200
    assert "" in corpus and lengths[corpus.index("")] == 2  # [CLS] [SEP]
    assert sum(n == 256 for n in lengths) >= 10  # at the window (some cut to it)
    assert any(not t.isascii() for t in corpus)


@pytest.mark.slow
def test_matches_float64_reference(minilm_source: Path, corpus: list[str], engine_vectors) -> None:
    ids, got = engine_vectors
    ref = BertReference(minilm_source)
    assert ids == [ref.token_ids(t) for t in corpus]  # the same tokens as the original tokenizer (truncated)
    cos = _cosines(got.astype(np.float64), ref.embed(corpus))
    worst = int(cos.argmin())
    assert cos.min() >= MIN_COSINE, (worst, corpus[worst][:80], cos.min())
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalized (a Normalize module)


def test_matches_sentence_transformers(corpus: list[str], engine_vectors) -> None:
    _, got = engine_vectors
    want = np.load(DATA / "st_minilm_l6_v2.npy")
    assert want.shape == got.shape
    cos = _cosines(got, want)
    worst = int(cos.argmin())
    assert cos.min() >= MIN_COSINE, (worst, corpus[worst][:80], cos.min())
