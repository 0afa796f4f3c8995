"""Small GGUF files written with gguf-py, for every architecture and ggml type the converter takes, and their
weights as gguf-py itself dequantizes them (the independent side of every reference comparison).

K-quants and IQ4 types cannot be quantized by gguf-py, so their tensors are random blocks whose float16 scales
are chosen to give the wanted standard deviation; every other type is quantized by gguf.quants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from engine.builder.ggml_quants import BLOCK_BYTES
from engine.builder.graph import LayerWeights, ModelWeights
from engine.builder.tokenizer import CHATML_TEMPLATE, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, synthetic_vocab

H, F, NH, KVH, LAYERS, VOCAB = 64, 128, 4, 2, 2, 320
# byte offsets of each random-block type's float16 fields (d first, then dmin where there is one)
F16_FIELDS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_NL: [0],
              Q.IQ4_XS: [0], Q.Q5_1: [0, 2]}


@dataclass
class TinyArch:
    """What the written file contains beyond the llama basics."""

    arch: str = "llama"
    qtypes: dict[str, Q] = field(default_factory=dict)  # tensor kind (attn_q, ffn_down, ...) -> type
    qtype: Q = Q.Q4_0  # every other linear weight
    embd_type: Q = Q.Q8_0
    output_type: Q | None = None  # a separate LM head (output.weight), else tied
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    fused: bool = False  # phi3: attn_qkv and ffn_up = [gate; up]
    sliding_window: int | None = None
    hidden: int = H  # K-quants need multiples of 256
    ffn: int = F
    head_size: int | None = None  # default hidden // NH
    rope_theta: float = 10000.0
    embd_std: float = 0.1  # gemma scales embeddings by sqrt(hidden): use ~0.1/sqrt(hidden) there
    extra: dict = field(default_factory=dict)  # more metadata: key -> value (typed by Python type)
    rope_freqs: bool = False
    tokenizer: str = "gpt2"  # or "llama" (SentencePiece)
    add_space_prefix: bool = True


def random_quant_bytes(rng: np.random.Generator, qtype: Q, n: int, k: int, std: float) -> np.ndarray:
    """Random raw blocks of an [n, k] tensor whose dequantized values have about ``std``."""
    block, nbytes = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    fields = F16_FIELDS[qtype]

    def set_fields(scale: np.ndarray) -> None:
        for j, start in enumerate(fields):
            sign = rng.choice([-1.0, 1.0], size=raw.shape[:2]) if j == 0 else 1.0  # d signed, dmin positive
            raw[..., start : start + 2] = (scale * sign).astype(np.float16)[..., None].view(np.uint8)

    set_fields(rng.uniform(0.5, 1.5, size=raw.shape[:2]) * 1e-2)
    actual = gguf.quants.dequantize(raw.reshape(n, -1), qtype).std()
    base = np.stack([raw[..., s : s + 2].copy().view(np.float16)[..., 0].astype(np.float64) for s in fields[:1]])[0]
    set_fields(np.abs(base) * std / actual)
    return raw.reshape(n, -1)


def spm_vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary: <pad> <eos> <bos> <unk>, 256 byte pieces, then ▁-words by score."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_CONTROL] * 4 + [TOKEN_BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = ["\u2581"] + list("etaoinshrdlucmfwypvbgkjqxz") + list("ETAOINSHRDL.,!?'0123456789")
    letters = list("etaoinshrd")
    pieces += ["\u2581" + a for a in letters] + [a + b for a in letters for b in letters]
    pieces += ["\u2581" + a + b for a in letters for b in letters] + ["\u2581\u2581", "\u2581\u2581\u2581\u2581"]
    for p in pieces:
        if len(tokens) == vocab_size:
            break
        if p not in tokens:
            tokens.append(p)
            types.append(TOKEN_NORMAL)
            scores.append(-float(len(tokens)))  # earlier pieces score higher, as SentencePiece orders them
    assert len(tokens) == vocab_size, len(tokens)
    return tokens, scores, types


def write_tiny_gguf(path: Path, cfg: TinyArch, *, seed: int = 0) -> Path:
    """A complete small GGUF for ``cfg`` (random weights)."""
    rng = np.random.default_rng(seed)
    arch, H, F = cfg.arch, cfg.hidden, cfg.ffn  # noqa: N806
    hd = cfg.head_size or H // NH
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(KVH)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    if hd != H // NH:
        w.add_uint32(f"{arch}.attention.key_length", hd)
        w.add_uint32(f"{arch}.attention.value_length", hd)
    if cfg.sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    for key, value in cfg.extra.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    if cfg.tokenizer == "gpt2":
        tokens, merges, types = synthetic_vocab(VOCAB)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges([f"{a} {b}" for a, b in merges])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(CHATML_TEMPLATE)
    else:
        tokens, scores, types = spm_vocab(VOCAB)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(cfg.add_space_prefix)

    def tensor(name: str, n: int, k: int, t: Q, std: float) -> None:
        x = rng.normal(0, std, size=(n, k)).astype(np.float32)
        if t == Q.F32:
            w.add_tensor(name, x)
        elif t == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif t in F16_FIELDS:
            w.add_tensor(name, random_quant_bytes(rng, t, n, k, std), raw_dtype=t)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, rng.uniform(0.8, 1.2, n).astype(np.float32))

    tensor("token_embd.weight", VOCAB, H, cfg.embd_type, cfg.embd_std)
    if cfg.output_type is not None:
        tensor("output.weight", VOCAB, H, cfg.output_type, 0.1)
    norm("output_norm.weight", H)
    if cfg.rope_freqs:
        w.add_tensor("rope_freqs.weight", rng.uniform(1.0, 8.0, hd // 2).astype(np.float32))
    shapes = {"attn_q": (NH * hd, H), "attn_k": (KVH * hd, H), "attn_v": (KVH * hd, H), "attn_output": (H, NH * hd),
              "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F)}
    if cfg.fused:
        shapes = {"attn_qkv": ((NH + 2 * KVH) * hd, H), "attn_output": (H, NH * hd), "ffn_up": (2 * F, H),
                  "ffn_down": (H, F)}
    for i in range(LAYERS):
        p = f"blk.{i}"
        norm(f"{p}.attn_norm.weight", H)
        norm(f"{p}.ffn_norm.weight", H)
        if cfg.qk_norm:
            norm(f"{p}.attn_q_norm.weight", hd)
            norm(f"{p}.attn_k_norm.weight", hd)
        if cfg.post_norms:
            norm(f"{p}.post_attention_norm.weight", H)
            norm(f"{p}.post_ffw_norm.weight", H)
        for kind, (n, k) in shapes.items():
            tensor(f"{p}.{kind}.weight", n, k, cfg.qtypes.get(kind, cfg.qtype), 3 * k ** -0.5)
            if cfg.qkv_bias and kind in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"{p}.{kind}.bias", rng.normal(0, 0.1, n).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_dequantized_weights(path: Path, cfg: TinyArch) -> ModelWeights:
    """ModelWeights from gguf's own reader and dequantizer (independent of engine.builder's quant code)."""
    reader = gguf.GGUFReader(str(path))
    t = {x.name: gguf.quants.dequantize(x.data, x.tensor_type).astype(np.float64) for x in reader.tensors}
    hd, F = cfg.head_size or cfg.hidden // NH, cfg.ffn  # noqa: N806
    layers = []
    for i in range(LAYERS):
        p = f"blk.{i}"
        if cfg.fused:
            qkv, gate_up = t[f"{p}.attn_qkv.weight"], t[f"{p}.ffn_up.weight"]
            q, k, v = np.split(qkv, [NH * hd, (NH + KVH) * hd])
            gate, up = gate_up[:F], gate_up[F:]
        else:
            q, k, v = t[f"{p}.attn_q.weight"], t[f"{p}.attn_k.weight"], t[f"{p}.attn_v.weight"]
            gate, up = t[f"{p}.ffn_gate.weight"], t[f"{p}.ffn_up.weight"]
        bias = None
        if f"{p}.attn_q.bias" in t:
            bias = np.concatenate([t[f"{p}.attn_q.bias"], t[f"{p}.attn_k.bias"], t[f"{p}.attn_v.bias"]])
        layers.append(LayerWeights(
            attn_norm=t[f"{p}.attn_norm.weight"], q=q, k=k, v=v, o=t[f"{p}.attn_output.weight"],
            ffn_norm=t[f"{p}.ffn_norm.weight"], gate=gate, up=up, down=t[f"{p}.ffn_down.weight"], qkv_bias=bias,
            q_norm=t.get(f"{p}.attn_q_norm.weight"), k_norm=t.get(f"{p}.attn_k_norm.weight"),
            post_attn_norm=t.get(f"{p}.post_attention_norm.weight"), post_ffn_norm=t.get(f"{p}.post_ffw_norm.weight")))
    emb = t["token_embd.weight"]
    return ModelWeights(embedding=emb, layers=layers, output_norm=t["output_norm.weight"],
                        lm_head=t.get("output.weight", emb), rope_freq_factors=t.get("rope_freqs.weight"))
