"""A float64 numpy forward pass of ModelWeights: the numerical reference the ONNX graph is tested against.

Written from the models' definitions (llama.cpp's graphs), not from engine.builder.graph: QK norm, sliding
windows as an explicit mask over the whole cache, per-layer rope bases, post-norms and softcaps.
Pure numpy, one sequence at a time, with a growing KV cache; no onnx, no onnxruntime.
"""

from __future__ import annotations

import numpy as np

from engine.builder.graph import ModelSpec, ModelWeights
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
            vec = lambda v: None if v is None else np.asarray(v, np.float64)  # noqa: E731
            self.layers.append(dict(
                attn_norm=vec(lw.attn_norm), qkv=qkv, qkv_bias=vec(lw.qkv_bias),
                o=dequantize(lw.o), ffn_norm=vec(lw.ffn_norm),
                gate=dequantize(lw.gate), up=dequantize(lw.up), down=dequantize(lw.down),
                q_norm=vec(lw.q_norm), k_norm=vec(lw.k_norm),
                post_attn_norm=vec(lw.post_attn_norm), post_ffn_norm=vec(lw.post_ffn_norm),
            ))
        self.freq_factors = weights.rope_freq_factors
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

    def _rope(self, x: np.ndarray, pos: np.ndarray, local: bool) -> np.ndarray:
        """x: [heads, S, hd] rotated at positions pos [S] (``local``: the sliding-window layers' rope)."""
        s = self.spec
        theta = s.rope_theta_local if local and s.rope_theta_local else s.rope_theta
        inv_freq = theta ** -(np.arange(0, s.head_size, 2) / s.head_size)  # [hd/2]
        if self.freq_factors is not None:
            inv_freq = inv_freq / np.asarray(self.freq_factors, np.float64)
        angles = (pos / (1.0 if local else s.rope_scale))[:, None] * inv_freq[None, :]  # [S, hd/2]
        cos, sin = np.cos(angles)[None], np.sin(angles)[None]  # [1, S, hd/2]
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
        keys = np.arange(start + n)[None, :]  # [1, T]
        causal = pos[:, None] >= keys  # [S, T]
        for i, lw in enumerate(self.layers):
            sliding = s.is_sliding(i)
            # a sliding-window layer sees its last sliding_window positions, itself included (llama.cpp's n_swa)
            visible = causal & (pos[:, None] - keys < s.sliding_window) if sliding else causal
            h = self._rms(x, lw["attn_norm"])
            qkv = h @ lw["qkv"].T
            if lw["qkv_bias"] is not None:
                qkv = qkv + lw["qkv_bias"]
            q = qkv[:, : nh * hd].reshape(n, nh, hd).transpose(1, 0, 2)  # [nh, S, hd]
            k = qkv[:, nh * hd : (nh + kvh) * hd].reshape(n, kvh, hd).transpose(1, 0, 2)  # [kvh, S, hd]
            v = qkv[:, (nh + kvh) * hd :].reshape(n, kvh, hd).transpose(1, 0, 2)
            if s.qk_norm:  # per head, before rotary
                q, k = self._rms(q, lw["q_norm"]), self._rms(k, lw["k_norm"])
            q, k = self._rope(q, pos, sliding), self._rope(k, pos, sliding)
            self.keys[i] = np.concatenate([self.keys[i], k], axis=1)  # [kvh, T, hd]
            self.values[i] = np.concatenate([self.values[i], v], axis=1)
            kk = np.repeat(self.keys[i], nh // kvh, axis=0)  # [nh, T, hd]
            vv = np.repeat(self.values[i], nh // kvh, axis=0)
            att = q @ kk.transpose(0, 2, 1) * scale  # [nh, S, T]
            if s.attn_logit_softcap:
                att = s.attn_logit_softcap * np.tanh(att / s.attn_logit_softcap)
            att = np.where(visible[None], att, -np.inf)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = (att @ vv).transpose(1, 0, 2).reshape(n, nh * hd) @ lw["o"].T  # [S, H]
            if s.post_norms:
                o = self._rms(o, lw["post_attn_norm"])
            x = x + o
            h = self._rms(x, lw["ffn_norm"])
            gate, up = h @ lw["gate"].T, h @ lw["up"].T
            if s.activation == "silu":
                act = gate / (1.0 + np.exp(-gate))
            else:
                act = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate ** 3)))
            mlp = (act * up) @ lw["down"].T
            if s.post_norms:
                mlp = self._rms(mlp, lw["post_ffn_norm"])
            x = x + mlp
        self.last_hidden = self._rms(x, self.output_norm)  # [S, H]: the final norm's output (pooled embeddings)
        logits = self.last_hidden @ self.lm_head.T
        if s.final_logit_softcap:
            logits = s.final_logit_softcap * np.tanh(logits / s.final_logit_softcap)
        return logits
