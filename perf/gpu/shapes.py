"""The model shapes the GPU benchmark runs, the H200's bandwidth and the prototype's reference figures.

Plain data; no engine, onnxruntime or torch import (both the engine bench and the PyTorch reference read it).
"""

from __future__ import annotations

# Hugging Face config names; all three tie the LM head to the embedding, head size 64.
SHAPES: dict[str, dict[str, int]] = {
    "smollm2-135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                         vocab_size=49152),
    "qwen2.5-0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                         vocab_size=151936),
    "llama-3.2-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                         vocab_size=128256),
}
HF_ARCH = {"smollm2-135m": "llama", "qwen2.5-0.5b": "qwen2", "llama-3.2-1b": "llama"}

# The sizes people run (issue 45), as bench GGUFs (perf/gpu/bench_gguf.py): the real models' shapes, GGUF
# architecture, rope base, trained context and vocabulary; the vocabulary file is the family's own (llama.cpp's
# models/ggml-vocab-llama-bpe.gguf, ggml-vocab-qwen2.gguf or the Qwen2.5-Coder GGUF), padded to ``vocab_size`` with
# unused [PAD] tokens as llama.cpp's converter pads Qwen2's. ``tied``: the LM head is the embedding.
GGUF_SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(SHAPES["llama-3.2-1b"], arch="llama", rope_theta=500000.0, context_length=8192, tied=True,
                         vocab="llama-bpe"),
    "llama-3.1-8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                         vocab_size=128256, arch="llama", rope_theta=500000.0, context_length=131072, tied=False,
                         llama3_rope=True, vocab="llama-bpe"),
    "qwen2.5-0.5b": dict(SHAPES["qwen2.5-0.5b"], arch="qwen2", rope_theta=1000000.0, context_length=32768, tied=True,
                         vocab="qwen2"),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                         vocab_size=151936, arch="qwen2", rope_theta=1000000.0, context_length=32768, tied=True,
                         vocab="qwen2"),
    "qwen2.5-7b": dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944,
                       vocab_size=152064, arch="qwen2", rope_theta=1000000.0, context_length=32768, tied=False,
                       vocab="qwen2"),
    "qwen2.5-32b": dict(hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8, intermediate_size=27648,
                        vocab_size=152064, arch="qwen2", rope_theta=1000000.0, context_length=32768, tied=False,
                        vocab="qwen2"),
}

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e, vendor datasheet
# A prototype loop (shared KV buffer, IOBinding, no graph capture, batch 1), tokens/s (issue 4).
PROTOTYPE_WEBGPU = {"smollm2-135m": 100.0, "qwen2.5-0.5b": 125.0, "llama-3.2-1b": 158.0}
PROTOTYPE_TORCH_EAGER = {"smollm2-135m": 43.0, "qwen2.5-0.5b": 57.0, "llama-3.2-1b": 71.0}

PROMPT_TOKENS = 8
OUTPUT_TOKENS = 128
