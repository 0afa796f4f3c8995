"""Synthetic models: the GGUF converter's graph with random weights, for tests and GPU benchmarks.

No download, no onnxruntime import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.builder.folder import write_model_folder
from engine.builder.graph import LayerWeights, ModelSpec, ModelWeights, build_graph
from engine.builder.quant import LinearWeight, random_block_quant
from engine.builder.tokenizer import CHATML_TEMPLATE, synthetic_tokenizer, tokenizer_config

QUANTS = ("int4", "q4_0", "q4_1", "fp16", "fp32")
# NOTE(builder): a small embedding and strong blocks keep random models from repeating one token
# forever with tied embeddings, so greedy outputs vary (tested: ~50 distinct tokens in 64 steps).
EMBED_STD = 0.1
LINEAR_GAIN = 3.0


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape and storage of a random llama-like model.

    ``quant``: "int4"/"q4_0" (MatMulNBits 4-bit, symmetric), "q4_1" (4-bit with the block-offset
    correction, as the default SmolLM2 model), "fp16"/"fp32" (float MatMul weights rounded to that
    precision). Quantized models use a Q8_0 (8-bit) embedding and LM head, like SmolLM2.
    ``dtype`` is the activation/KV dtype. Sizes must be multiples of 32 where weights are quantized.
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    max_length: int = 256
    quant: str = "int4"
    dtype: str = "float32"
    seed: int = 0
    head_size: int | None = None  # default hidden_size // num_heads
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    chat_template: str | None = None  # None: ChatML
    added_tokens: tuple[str, ...] = ()  # non-special added tokens at the last ids (e.g. "<tool_call>")

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise ValueError(f"quant must be one of {QUANTS}, got {self.quant!r}")
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"dtype must be float32 or float16, got {self.dtype!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.quant not in ("fp16", "fp32"):
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % 32:
                    raise ValueError(f"{name} must be a multiple of 32 for quant={self.quant}, got {getattr(self, name)}")

    def model_spec(self) -> ModelSpec:
        return ModelSpec(
            hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_size=self.head_size or self.hidden_size // self.num_heads,
            intermediate_size=self.intermediate_size, vocab_size=self.vocab_size, context_length=self.max_length,
            rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
        )


def synthetic_weights(spec: SyntheticSpec) -> ModelWeights:
    """Random weights for ``spec`` (deterministic in ``spec.seed``)."""
    ms = spec.model_spec()
    rng = np.random.default_rng(spec.seed)
    fmt = "q4_0" if spec.quant == "int4" else spec.quant

    def linear(n: int, k: int, std: float) -> LinearWeight:
        std *= LINEAR_GAIN
        if fmt in ("fp16", "fp32"):
            w = rng.normal(0.0, std, size=(n, k))
            return w.astype(np.float16 if fmt == "fp16" else np.float32).astype(np.float32)
        return random_block_quant(rng, n, k, fmt=fmt, std=std)

    def embedding(n: int, k: int, std: float) -> LinearWeight:
        if fmt in ("fp16", "fp32"):
            w = rng.normal(0.0, std, size=(n, k))
            return w.astype(np.float16 if fmt == "fp16" else np.float32).astype(np.float32)
        return random_block_quant(rng, n, k, fmt="q8_0", std=std)

    def norm(n: int) -> np.ndarray:
        return rng.uniform(0.8, 1.2, size=n).astype(np.float16).astype(np.float32)

    h, f, hd = ms.hidden_size, ms.intermediate_size, ms.head_size
    layers = []
    for _ in range(ms.num_layers):
        layers.append(LayerWeights(
            attn_norm=norm(h),
            q=linear(ms.num_heads * hd, h, h ** -0.5), k=linear(ms.num_kv_heads * hd, h, h ** -0.5),
            v=linear(ms.num_kv_heads * hd, h, h ** -0.5), o=linear(h, ms.num_heads * hd, (ms.num_heads * hd) ** -0.5),
            ffn_norm=norm(h),
            gate=linear(f, h, h ** -0.5), up=linear(f, h, h ** -0.5), down=linear(h, f, f ** -0.5),
        ))
    emb = embedding(ms.vocab_size, h, EMBED_STD)
    lm_head = emb if spec.tie_word_embeddings else embedding(ms.vocab_size, h, EMBED_STD)
    return ModelWeights(embedding=emb, layers=layers, output_norm=norm(h), lm_head=lm_head)


def build_synthetic(out_dir: str | Path, spec: SyntheticSpec, *, accuracy_level: int = 0,
                    overwrite: bool = True) -> Path:
    """Builds a complete model folder with random weights (no download).

    Args:
        out_dir: the folder to create (replaced when it exists and ``overwrite``).
        spec: shape, quantization, activation dtype and seed.
        accuracy_level: MatMulNBits accuracy level (0 exact, 4 int8 activations).
    Returns:
        The folder path, resolved. Its tokenizer is byte-level BPE with ChatML specials
        (<|endoftext|>=0, <|im_start|>=1 (bos), <|im_end|>=2 (eos, pad)).

    Example:
        >>> build_synthetic(tmp_path / "tiny", SyntheticSpec(vocab_size=512))  # doctest: +SKIP
    """
    ms = spec.model_spec()
    weights = synthetic_weights(spec)

    def model(data):  # the weights go to the folder's data file as the graph is built
        return build_graph(ms, weights, dtype=spec.dtype, accuracy_level=accuracy_level, data=data)

    tok, special = synthetic_tokenizer(spec.vocab_size, spec.added_tokens)
    tok_cfg = tokenizer_config(tok, special, chat_template=spec.chat_template or CHATML_TEMPLATE,
                               model_max_length=spec.max_length)
    return write_model_folder(Path(out_dir), model, ms, tok, special, tok_cfg, max_length=spec.max_length,
                              overwrite=overwrite)
