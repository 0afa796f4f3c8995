"""An independent float64 numpy implementation of a sentence-transformers BERT model (the parity reference).

Written from the model's definition (Hugging Face's BertModel: post-norm blocks, erf GELU, additive padding
mask; sentence-transformers' Pooling and Normalize), reading the original folder's safetensors and
tokenizer.json. It shares no code with engine/builder/encoder.py or engine/embedding.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.special import erf
from tokenizers import Tokenizer


class BertReference:
    """``embed(texts)`` -> float64 [N, H] as sentence-transformers computes them (truncated to max_seq_length)."""

    def __init__(self, folder: Path) -> None:
        from safetensors.numpy import load_file

        self.config = json.loads((folder / "config.json").read_text())
        st = json.loads((folder / "sentence_bert_config.json").read_text())
        self.max_seq_length = int(st["max_seq_length"])
        pool = json.loads((folder / "1_Pooling" / "config.json").read_text())
        self.pooling = next(k for k in ("pooling_mode_mean_tokens", "pooling_mode_cls_token",
                                         "pooling_mode_max_tokens") if pool.get(k))
        modules = json.loads((folder / "modules.json").read_text())
        self.normalize = any(m["type"].endswith("Normalize") for m in modules)
        self.w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_seq_length)

    def token_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def hidden(self, texts_ids: list[list[int]]) -> list[np.ndarray]:
        """Last hidden states [S_i, H] of each unpadded text.

        The position-wise parts (linears, LayerNorm, GELU) run on every text's tokens stacked [sum S_i, H]
        (big matrix products); attention runs per text, so no text sees another's tokens and no mask is needed.
        """
        w, eps = self.w, float(self.config["layer_norm_eps"])
        heads = int(self.config["num_attention_heads"])
        lengths = [len(ids) for ids in texts_ids]
        starts = np.cumsum([0, *lengths])
        positions = np.concatenate([np.arange(n) for n in lengths])
        x = w["embeddings.word_embeddings.weight"][np.concatenate(texts_ids)] \
            + w["embeddings.position_embeddings.weight"][positions] + w["embeddings.token_type_embeddings.weight"][0]
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)  # [T, H]
        for i in range(int(self.config["num_hidden_layers"])):
            p = f"encoder.layer.{i}"

            def lin(name: str, v: np.ndarray) -> np.ndarray:
                return v @ w[f"{p}.{name}.weight"].T + w[f"{p}.{name}.bias"]

            q, k, v = (lin(f"attention.self.{n}", x) for n in ("query", "key", "value"))  # [T, H]
            hd = q.shape[1] // heads
            ctx = np.empty_like(q)
            for a, b in zip(starts[:-1], starts[1:]):
                qh, kh, vh = (t[a:b].reshape(b - a, heads, hd).transpose(1, 0, 2) for t in (q, k, v))  # [nh, S, hd]
                scores = qh @ kh.transpose(0, 2, 1) / np.sqrt(hd)  # [nh, S, S]
                scores = np.exp(scores - scores.max(-1, keepdims=True))
                probs = scores / scores.sum(-1, keepdims=True)
                ctx[a:b] = (probs @ vh).transpose(1, 0, 2).reshape(b - a, heads * hd)
            x = _layer_norm(lin("attention.output.dense", ctx) + x, w[f"{p}.attention.output.LayerNorm.weight"],
                            w[f"{p}.attention.output.LayerNorm.bias"], eps)
            h = lin("intermediate.dense", x)
            h = 0.5 * h * (1.0 + erf(h / np.sqrt(2.0)))
            x = _layer_norm(lin("output.dense", h) + x, w[f"{p}.output.LayerNorm.weight"],
                            w[f"{p}.output.LayerNorm.bias"], eps)
        return [x[a:b] for a, b in zip(starts[:-1], starts[1:])]

    def pool(self, h: np.ndarray) -> np.ndarray:
        if self.pooling == "pooling_mode_mean_tokens":
            v = h.mean(0)
        elif self.pooling == "pooling_mode_cls_token":
            v = h[0]
        else:
            v = h.max(0)
        return v / max(np.linalg.norm(v), 1e-12) if self.normalize else v

    def embed(self, texts: list[str]) -> np.ndarray:
        """float64 [N, H]."""
        return np.stack([self.pool(h) for h in self.hidden([self.token_ids(t) for t in texts])])


def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta
