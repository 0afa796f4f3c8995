"""A float64 numpy forward pass of ModelWeights: the numerical reference the ONNX graph is tested against.

Pure numpy, one sequence at a time, with a growing KV cache; no onnx, no onnxruntime.
"""

from __future__ import annotations

import numpy as np

from engine.builder.graph import ModelSpec, ModelWeights, rope_cache
from engine.builder.quant import dequantize


class ReferenceModel:
    """Dequantizes every weight once and runs the decoder exactly (float64).

    Usage:
        >>> ref = ReferenceModel(spec, weights)  # doctest: +SKIP
        >>> logits = ref.forward([1, 2, 3])       # [3, vocab], cache now holds 3 positions
        >>> logits = ref.forward([4])             # [1, vocab], position 3
    """

    def __init__(self, spec: ModelSpec, weights: ModelWeights) -> None:
        self.spec = spec
        self.embedding = dequantize(weights.embedding)  # [V, H]
        self.lm_head = self.embedding if weights.lm_head is weights.embedding else dequantize(weights.lm_head)
        self.output_norm = np.asarray(weights.output_norm, np.float64)
        self.layers = []
        for lw in weights.layers:
            qkv = np.concatenate([dequantize(lw.q), dequantize(lw.k), dequantize(lw.v)], axis=0)
            self.layers.append(dict(
                attn_norm=np.asarray(lw.attn_norm, np.float64), qkv=qkv,
                qkv_bias=None if lw.qkv_bias is None else np.asarray(lw.qkv_bias, np.float64),
                o=dequantize(lw.o), ffn_norm=np.asarray(lw.ffn_norm, np.float64),
                gate=dequantize(lw.gate), up=dequantize(lw.up), down=dequantize(lw.down),
            ))
        self.cos, self.sin = rope_cache(spec, weights.rope_freq_factors)  # [ctx, hd/2]
        self.reset()

    def reset(self) -> None:
        """Empties the KV cache."""
        self.keys: list[np.ndarray] = [np.zeros((self.spec.num_kv_heads, 0, self.spec.head_size))] * len(self.layers)
        self.values: list[np.ndarray] = list(self.keys)

    @property
    def num_cached(self) -> int:
        return self.keys[0].shape[1]

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.spec.rms_norm_eps) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: [heads, S, hd] rotated at positions pos [S]."""
        cos, sin = self.cos[pos][None], self.sin[pos][None]  # [1, S, hd/2]
        if self.spec.rope_interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        r1, r2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        out = np.empty_like(x)
        if self.spec.rope_interleaved:
            out[..., 0::2], out[..., 1::2] = r1, r2
        else:
            out[..., :half], out[..., half:] = r1, r2
        return out

    def forward(self, token_ids: list[int]) -> np.ndarray:
        """Appends ``token_ids`` after the cached positions.

        Returns:
            float64 logits [len(token_ids), vocab].
        """
        s = self.spec
        nh, kvh, hd = s.num_heads, s.num_kv_heads, s.head_size
        start = self.num_cached
        n = len(token_ids)
        pos = np.arange(start, start + n)
        x = self.embedding[np.asarray(token_ids)]  # [S, H]
        if s.embedding_multiplier is not None:
            x = x * s.embedding_multiplier
        scale = s.attention_scale if s.attention_scale is not None else hd ** -0.5
        causal = pos[:, None] >= np.arange(start + n)[None, :]  # [S, T]
        for i, lw in enumerate(self.layers):
            h = self._rms(x, lw["attn_norm"])
            qkv = h @ lw["qkv"].T
            if lw["qkv_bias"] is not None:
                qkv = qkv + lw["qkv_bias"]
            q = qkv[:, : nh * hd].reshape(n, nh, hd).transpose(1, 0, 2)  # [nh, S, hd]
            k = qkv[:, nh * hd : (nh + kvh) * hd].reshape(n, kvh, hd).transpose(1, 0, 2)  # [kvh, S, hd]
            v = qkv[:, (nh + kvh) * hd :].reshape(n, kvh, hd).transpose(1, 0, 2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            self.keys[i] = np.concatenate([self.keys[i], k], axis=1)  # [kvh, T, hd]
            self.values[i] = np.concatenate([self.values[i], v], axis=1)
            kk = np.repeat(self.keys[i], nh // kvh, axis=0)  # [nh, T, hd]
            vv = np.repeat(self.values[i], nh // kvh, axis=0)
            att = q @ kk.transpose(0, 2, 1) * scale  # [nh, S, T]
            att = np.where(causal[None], att, -np.inf)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = (att @ vv).transpose(1, 0, 2).reshape(n, nh * hd)  # [S, nh*hd]
            x = x + o @ lw["o"].T
            h = self._rms(x, lw["ffn_norm"])
            gate, up = h @ lw["gate"].T, h @ lw["up"].T
            if s.activation == "silu":
                act = gate / (1.0 + np.exp(-gate))
            else:
                act = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate ** 3)))
            x = x + (act * up) @ lw["down"].T
        return self._rms(x, self.output_norm) @ self.lm_head.T
