"""Pooled decoder embeddings (llama.cpp's --embeddings --pooling): the builder's embedding.onnx beside a chat
model, run batched by the embedding engine, against the float64 reference decoder's final-norm hidden states
(engine/builder/reference.py) for every pooling mode; and the default model's folder has the graph too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.builder import SyntheticSpec
from engine.builder.reference import ReferenceModel
from engine.builder.synthetic import synthetic_weights
from engine.embedding import EmbeddingConfig, EmbeddingEngine, read_embedding_folder

TEXTS = ["Hello there, how are you?", "a", "", "The same words. " * 12, "Ünïcödé テスト 😀"]


@pytest.fixture(scope="module")
def reference_hidden(tiny_model: Path) -> list[np.ndarray]:
    """float64 final-norm hidden states [S, H] of each text (tiny_model is SyntheticSpec() with exact weights)."""
    spec = SyntheticSpec()
    ref = ReferenceModel(spec.model_spec(), synthetic_weights(spec))
    folder = read_embedding_folder(tiny_model)
    out = []
    for text in TEXTS:
        ids = folder.tokenizer.hf.encode(text, add_special_tokens=True).ids or [1]
        ref.reset()
        ref.forward(ids)
        out.append(ref.last_hidden)
    return out


@pytest.mark.parametrize("pooling", ["last", "mean", "cls", "max"])
def test_pooled_hidden_states_match_the_reference(tiny_model: Path, reference_hidden: list[np.ndarray],
                                                  pooling: str) -> None:
    engine = EmbeddingEngine.from_model_dir(tiny_model, EmbeddingConfig(pooling=pooling, nice=0))
    try:
        assert engine.kind == "decoder" and engine.pooling == pooling
        ids = [i or [1] for i in engine.tokenize(TEXTS)]
        got = np.stack(engine.embed_sync(engine.check(ids)))  # one batch, right-padded
        alone = np.stack([engine.embed_sync([i])[0] for i in ids])
    finally:
        engine.shutdown()
    pool = {"last": lambda h: h[-1], "mean": lambda h: h.mean(0), "cls": lambda h: h[0], "max": lambda h: h.max(0)}
    want = np.stack([pool[pooling](h) for h in reference_hidden])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(got, alone, atol=1e-5)  # padding does not leak into a shorter row


def test_pooling_none_gives_every_token(tiny_model: Path, reference_hidden: list[np.ndarray]) -> None:
    engine = EmbeddingEngine.from_model_dir(tiny_model, EmbeddingConfig(pooling="none", nice=0))
    try:
        (per_token,) = engine.embed_sync(engine.check(engine.tokenize(TEXTS[:1])))
    finally:
        engine.shutdown()
    assert per_token.shape == reference_hidden[0].shape  # [S, H], not normalized
    np.testing.assert_allclose(per_token, reference_hidden[0], rtol=1e-3, atol=1e-3)


def test_default_model_folder_has_the_embedding_graph(default_model: Path) -> None:
    folder = read_embedding_folder(default_model)
    assert folder.kind == "decoder" and folder.pooling == "last" and folder.dimension == 576
    assert folder.model_file.name == "embedding.onnx"
    # the weights are stored once: embedding.onnx is a small graph pointing into model.onnx.data
    assert folder.model_file.stat().st_size < (default_model / "model.onnx").stat().st_size + 1_000_000
    assert sorted(p.name for p in default_model.glob("*.data")) == ["model.onnx.data"]
