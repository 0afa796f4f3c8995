"""Bench models as GGUF files: a real model's shape (perf/gpu/shapes.py ``GGUF_SHAPES``: Llama-3.2-1B, Llama-3.1-8B,
Qwen2.5-1.5B/7B/32B) with random weights at a small scale (finite float16 logits, unlike
``engine.builder.build_synthetic``'s) and the family's real vocabulary, written tensor by tensor with gguf-py (a 32B
file never sits in memory). The same file serves llama.cpp's llama-server and, through ``ortserve convert``, ortserve
(issues 38 and 45).

The vocabulary comes from llama.cpp's ``models/ggml-vocab-llama-bpe.gguf`` / ``ggml-vocab-qwen2.gguf`` (tokenizer fields
only, no tensors) or any GGUF of the family (the Qwen2.5-Coder GGUF), with gguf-py from the same sources (llama-cpp-python's
sdist vendors both; ``perf/gpu/peer_sources.sh`` packs them). Every ``tokenizer.*`` field is copied; a vocabulary
shorter than the shape's is padded with unused ``[PADn]`` tokens, as llama.cpp's converter pads Qwen2's.

    python -m perf.gpu.bench_gguf --vocab ggml-vocab-llama-bpe.gguf --out bench-1b.gguf [--shape llama-3.2-1b] [--untied]
    python -m perf.gpu.bench_gguf --vocab ggml-vocab-llama-bpe.gguf --shape llama-3.1-8b --mix Q4_K_M --out 8b.gguf

Quantisation mixes (``--mix``), as llama.cpp's llama-quantize lays them out (src/llama-quant.cpp):
  - ``Q4_0-all`` (the default, issue 38's file): every linear and the embedding Q4_0;
  - ``Q4_0``: Q4_0, with the LM head (or a tied embedding) in Q6_K;
  - ``Q4_K_M``: Q4_K, with Q6_K for the LM head and for attn_v and ffn_down in the layers ``use_more_bits`` picks
    (the first and last eighth, and every third between).

With centred codes (the default) greedy output varies and prompt-lookup drafts miss; ``--offset-codes`` (Q4_0 codes
0..15, every weight's mean -d/2, issue 38's first bench file) makes every prompt's greedy output one repeated token, so
drafts always hit. ``--untied`` gives the LM head weights of its own (the CUDA engine tests' model).

Weights have standard deviation about ``std`` (0.02 by default, as a trained model's initialization) and mean about 0
in every format: Q4_0 codes uniform in 1..15 with ``d = std / 4.32``; Q4_K sub-block scales 24..40 and mins that cancel
the codes' mean; Q6_K sub-block scales of random sign. Norms are ones, Qwen2's q/k/v biases small. Residual and logits
stay within a few tens, so float16 activations never overflow.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from perf.gpu.shapes import GGUF_SHAPES

Q4_0_BLOCK = 32  # weights per block
Q4_0_BYTES = 18  # fp16 scale + 16 bytes of codes
QK_K = 256  # weights per K-quant super-block
Q4_K_BYTES = 144  # d, dmin (fp16), 12 bytes of 6-bit sub-block scales and mins, 128 bytes of 4-bit codes
Q6_K_BYTES = 210  # 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 sub-block scales, d (fp16)
MIXES = ("Q4_0-all", "Q4_0", "Q4_K_M")
FILE_TYPES = {"Q4_0-all": 2, "Q4_0": 2, "Q4_K_M": 15}  # llama_ftype: MOSTLY_Q4_0, MOSTLY_Q4_K_M
ROW_CHUNK_BYTES = 64 << 20  # random blocks are made this many bytes at a time
DISK_MARGIN_BYTES = 2 << 30  # left free on the disk after the file
CODE_STD = float(np.std(np.arange(1, 16) - 8))  # 4.32
OFFSET_CODE_STD = float(np.std(np.arange(16) - 8))  # 4.61
# Llama 3's chat template (enough for /v1/chat/completions; the bench uses /v1/completions)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int, std: float, offset: bool = False) -> np.ndarray:
    """uint8 ``[rows, cols / 32 * 18]``: random Q4_0 blocks whose weights have standard deviation ``std``; ``offset``:
    codes 0..15 (mean -d/2, the model whose greedy output repeats one token: drafts always hit)."""
    if cols % Q4_0_BLOCK:
        raise ValueError(f"Q4_0 needs columns in multiples of {Q4_0_BLOCK}, got {cols}")
    if offset:
        blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
        blocks[:, :, :2] = np.frombuffer(np.float16(std / OFFSET_CODE_STD).tobytes(), dtype=np.uint8)
        return blocks.reshape(rows, -1)
    # NOTE(perf): codes 1..15 (values -7..7 times d), centred: with 0..15 every weight's mean is -d/2, and that common
    # offset builds up an all-ones direction in the residual stream until every prompt gives the same greedy token
    codes = rng.integers(1, 16, size=(rows, cols // Q4_0_BLOCK, 2, Q4_0_BYTES - 2), dtype=np.uint8)
    blocks = np.empty((rows, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    blocks[:, :, 2:] = codes[:, :, 0] | (codes[:, :, 1] << 4)
    scale = np.frombuffer(np.float16(std / CODE_STD).tobytes(), dtype=np.uint8)
    blocks[:, :, :2] = scale  # every block's scale (the codes are uniform, so one scale gives the std)
    return blocks.reshape(rows, -1)


def q4_k_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """uint8 ``[rows, cols / 256 * 144]``: random Q4_K blocks (``x = d*sc*q - dmin*m`` per 32 weights) whose weights have
    standard deviation about ``std`` and mean about 0: codes uniform in 0..15, scales ``sc`` 24..40, ``dmin = 8d`` and
    ``m = round(7.5 sc / 8)``, so ``dmin*m`` cancels the codes' mean within ``4d``."""
    if cols % QK_K:
        raise ValueError(f"Q4_K needs columns in multiples of {QK_K}, got {cols}")
    nb = rows * (cols // QK_K)
    blocks = np.empty((nb, Q4_K_BYTES), np.uint8)
    d = np.float16(std / (32.0 * float(np.std(np.arange(16)))))
    blocks[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    blocks[:, 2:4] = np.frombuffer(np.float16(8 * float(d)).tobytes(), np.uint8)
    sc = rng.integers(24, 41, size=(nb, 8), dtype=np.uint8)
    m = np.rint(sc * (7.5 / 8)).astype(np.uint8)
    # 6-bit (scale, min) pairs, packed as ggml's get_scale_min_k4 reads them
    blocks[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    blocks[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    blocks[:, 12:16] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    blocks[:, 16:] = rng.integers(0, 256, size=(nb, 128), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def q6_k_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """uint8 ``[rows, cols / 256 * 210]``: random Q6_K blocks (``x = d*sc*(q-32)`` per 16 weights), codes uniform in
    0..63, scales ``sc`` of magnitude 16..31 and random sign (so the codes' mean -0.5 does not add up), weights of
    standard deviation about ``std``."""
    if cols % QK_K:
        raise ValueError(f"Q6_K needs columns in multiples of {QK_K}, got {cols}")
    nb = rows * (cols // QK_K)
    blocks = np.empty((nb, Q6_K_BYTES), np.uint8)
    blocks[:, :192] = rng.integers(0, 256, size=(nb, 192), dtype=np.uint8)
    sc = rng.integers(16, 32, size=(nb, 16)).astype(np.int8) * rng.choice(np.array([-1, 1], np.int8), size=(nb, 16))
    blocks[:, 192:208] = sc.view(np.uint8)
    d = np.float16(std / (23.5 * float(np.std(np.arange(64) - 32))))
    blocks[:, 208:210] = np.frombuffer(d.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


_BLOCKS = {"Q4_0": (Q4_0_BLOCK, Q4_0_BYTES), "Q4_K": (QK_K, Q4_K_BYTES), "Q6_K": (QK_K, Q6_K_BYTES),
           "Q5_0": (32, 22), "Q8_0": (32, 34)}
K_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama-quant.cpp, for rows that are no whole number of super-blocks
_FLOAT_BYTES = {"F32": 4, "F16": 2}


def q5_0_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """uint8 ``[rows, cols / 32 * 22]``: random Q5_0 blocks (``x = d*(q-16)``, 5-bit codes, the fifth bits in 4 bytes)
    whose weights have standard deviation about ``std``."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 22), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(std / float(np.std(np.arange(32) - 16))).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def q8_0_blocks(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """uint8 ``[rows, cols / 32 * 34]``: random Q8_0 blocks (``x = d*q``, int8 codes in -127..127)."""
    blocks = np.empty((rows, cols // 32, 34), np.uint8)
    blocks[:, :, 2:] = rng.integers(-127, 128, size=(rows, cols // 32, 32), dtype=np.int8).view(np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(std / float(np.std(np.arange(-127, 128)))).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule for the Q4_K_M layers whose attn_v and ffn_down take Q6_K."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def tensor_type(name: str, mix: str, layer: int, num_layers: int, tied: bool, cols: int = QK_K) -> str:
    """The ggml type of a linear tensor in ``mix`` (see the module docstring); a K-quant tensor whose rows are not a
    whole number of 256-weight super-blocks (the 0.5B's 896) takes llama.cpp's fallback (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    head = name == "output.weight" or (tied and name == "token_embd.weight")
    if mix == "Q4_0-all":
        return "Q4_0"
    if head:
        kind = "Q6_K"
    elif mix == "Q4_K_M" and name.split(".")[-2] in ("attn_v", "ffn_down") and use_more_bits(layer, num_layers):
        kind = "Q6_K"
    else:
        kind = "Q4_K" if mix == "Q4_K_M" else "Q4_0"
    return K_FALLBACK.get(kind, kind) if cols % QK_K else kind


def llama3_rope_factors(head_size: int, theta: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                        original: int = 8192) -> np.ndarray:
    """Llama 3.1's rope_freqs.weight: the divisor of each rotary frequency (HF's rope_type "llama3")."""
    freqs = 1.0 / theta ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size)
    wavelen = 2 * np.pi / freqs
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    divisor = 1.0 / ((1 - smooth) / factor + smooth)
    divisor = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, divisor))
    return divisor.astype(np.float32)


def write_bench_gguf(vocab_path: Path, out: Path, shape: dict, std: float = 0.02, seed: int = 0,
                     context_length: int | None = None, untied: bool = False, offset: bool = False,
                     mix: str = "Q4_0-all", embed_rows=None, head_rows=None) -> Path:
    """Write the bench GGUF (see the module docstring) tensor by tensor; returns ``out``.

    Args:
        shape: a ``GGUF_SHAPES`` entry, or any dict of the ``SHAPES`` keys (then a tied llama).
        untied: an LM head of its own (random like the rest) where the shape ties it: greedy output is then varied
            (tied, a random model's logits favour the token just read, so its greedy output repeats one token and
            prompt-lookup drafts always hit).
        mix: one of MIXES.
        embed_rows, head_rows: planted weights (perf/gpu/draft_pair.py): ``f(start, n) -> float32 [n, hidden]``, rows
            ``start..start+n`` of the embedding (stored F16) and of an LM head of its own (stored Q8_0, gguf-py's
            quantizer: it has no K-quant one); both or neither.
    """
    import gguf

    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    vocab = gguf.GGUFReader(str(vocab_path))
    arch = shape.get("arch", "llama")
    h, layers, heads = shape["hidden_size"], shape["num_layers"], shape["num_heads"]
    kv_heads, ffn, n_vocab = shape["num_kv_heads"], shape["intermediate_size"], shape["vocab_size"]
    head = h // heads
    if (embed_rows is None) != (head_rows is None):
        raise ValueError("embed_rows and head_rows go together")
    planted = embed_rows is not None
    tied = shape.get("tied", True) and not untied and not planted
    tokens = [_string_at(vocab.fields["tokenizer.ggml.tokens"], i)
              for i in range(len(vocab.fields["tokenizer.ggml.tokens"].data))]
    if len(tokens) > n_vocab or (len(tokens) < n_vocab and arch != "qwen2"):
        raise ValueError(f"{vocab_path} holds {len(tokens)} tokens, the shape {n_vocab}")
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"ortserve-bench-{arch}-{h}x{layers}-random")
    w.add_block_count(layers)
    w.add_context_length(context_length or shape.get("context_length", 8192))
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(float(shape.get("rope_theta", 500000.0)))
    w.add_layer_norm_rms_eps(1e-6 if arch == "qwen2" else 1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(FILE_TYPES[mix])
    _copy_tokenizer(w, vocab, tokens, n_vocab)
    if "tokenizer.chat_template" not in vocab.fields:
        w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)
    # 1. Every tensor's name, shape and type first (the header), then the data one tensor at a time.
    plan: list[tuple[str, tuple[int, ...], str]] = []  # (name, [rows, cols] or [n], ggml type name or "F32")

    def linear(name: str, rows: int, cols: int, layer: int = 0) -> None:
        plan.append((name, (rows, cols), tensor_type(name, mix, layer, layers, tied, cols)))

    if planted:
        plan.append(("token_embd.weight", (n_vocab, h), "F16"))
    else:
        linear("token_embd.weight", n_vocab, h)  # tied: llama.cpp and the converter use it as the LM head too
    plan.append(("output_norm.weight", (h,), "F32"))
    if planted:
        plan.append(("output.weight", (n_vocab, h), "Q8_0"))
    elif not tied:
        linear("output.weight", n_vocab, h)
    if shape.get("llama3_rope"):
        plan.append(("rope_freqs.weight", (head // 2,), "F32"))
    for i in range(layers):
        p = f"blk.{i}."
        plan.append((p + "attn_norm.weight", (h,), "F32"))
        plan.append((p + "ffn_norm.weight", (h,), "F32"))
        linear(p + "attn_q.weight", heads * head, h, i)
        linear(p + "attn_k.weight", kv_heads * head, h, i)
        linear(p + "attn_v.weight", kv_heads * head, h, i)
        if arch == "qwen2":
            for part, n in (("q", heads * head), ("k", kv_heads * head), ("v", kv_heads * head)):
                plan.append((f"{p}attn_{part}.bias", (n,), "F32"))
        linear(p + "attn_output.weight", h, heads * head, i)
        linear(p + "ffn_gate.weight", ffn, h, i)
        linear(p + "ffn_up.weight", ffn, h, i)
        linear(p + "ffn_down.weight", h, ffn, i)
    sizes = [_FLOAT_BYTES[kind] * int(np.prod(dims)) if kind in _FLOAT_BYTES
             else dims[0] * dims[1] // _BLOCKS[kind][0] * _BLOCKS[kind][1] for name, dims, kind in plan]
    free = shutil.disk_usage(Path(out).resolve().parent).free
    if sum(sizes) + DISK_MARGIN_BYTES > free:
        raise OSError(f"{out}: the file takes {sum(sizes) / 2**30:.1f} GiB, the disk has {free / 2**30:.1f} GiB free")
    for name, dims, kind in plan:
        if kind == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        elif kind == "F16":
            w.add_tensor_info(name, dims, np.dtype(np.float16), 2 * int(np.prod(dims)))
        else:
            block, nbytes = _BLOCKS[kind]
            byte_shape = (dims[0], dims[1] // block * nbytes)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, kind in plan:
        if kind == "F32":
            w.write_tensor_data(_vector(rng, name, dims[0], head, float(shape.get("rope_theta", 500000.0))))
        elif planted and name in ("token_embd.weight", "output.weight"):
            w.write_tensor_data(_planted(embed_rows if name == "token_embd.weight" else head_rows, kind, *dims))
        else:
            w.write_tensor_data(_blocks(rng, kind, dims[0], dims[1], std, offset))
    w.close()
    return out


def _vector(rng: np.random.Generator, name: str, n: int, head: int, theta: float) -> np.ndarray:
    if name == "rope_freqs.weight":
        return llama3_rope_factors(head, theta)
    if name.endswith(".bias"):
        return rng.normal(0.0, 0.02, size=n).astype(np.float32)
    return np.ones(n, dtype=np.float32)  # norms


def _planted(rows_fn, kind: str, rows: int, cols: int) -> np.ndarray:
    """A planted tensor, made a chunk of rows at a time: F16 values or gguf-py's Q8_0 blocks."""
    from gguf import GGMLQuantizationType, quants

    out = np.empty((rows, cols), np.float16) if kind == "F16" else np.empty((rows, cols // 32 * 34), np.uint8)
    step = max(1, ROW_CHUNK_BYTES // (4 * cols))
    for start in range(0, rows, step):
        x = rows_fn(start, min(step, rows - start)).astype(np.float32)
        out[start : start + len(x)] = (x.astype(np.float16) if kind == "F16"
                                       else quants.quantize(x, GGMLQuantizationType.Q8_0))
    return out


def _blocks(rng: np.random.Generator, kind: str, rows: int, cols: int, std: float, offset: bool) -> np.ndarray:
    """One tensor's random blocks, made ROW_CHUNK_BYTES at a time into one array."""
    block, nbytes = _BLOCKS[kind]
    out = np.empty((rows, cols // block * nbytes), np.uint8)
    step = max(1, ROW_CHUNK_BYTES // out.shape[1])
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if kind == "Q4_0":
            out[start : start + n] = q4_0_blocks(rng, n, cols, std, offset)
        elif kind == "Q4_K":
            out[start : start + n] = q4_k_blocks(rng, n, cols, std)
        elif kind == "Q5_0":
            out[start : start + n] = q5_0_blocks(rng, n, cols, std)
        elif kind == "Q8_0":
            out[start : start + n] = q8_0_blocks(rng, n, cols, std)
        else:
            out[start : start + n] = q6_k_blocks(rng, n, cols, std)
    return out


def _copy_tokenizer(w, vocab, tokens: list[str], n_vocab: int) -> None:
    """Every ``tokenizer.*`` field of the vocabulary file, the token list (and types) padded to ``n_vocab``."""
    import gguf

    for key, field in vocab.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if key == "tokenizer.ggml.tokens":
            w.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), n_vocab)])
        elif key == "tokenizer.ggml.token_type":
            types = [int(field.parts[i][0]) for i in field.data]
            w.add_token_types(types + [int(gguf.TokenType.UNUSED)] * (n_vocab - len(types)))
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, list(field.contents()), field.types[0], field.types[-1])
        else:
            w.add_key_value(key, field.contents(), field.types[0])


def _string_at(field, i: int) -> str:
    return bytes(field.parts[field.data[i]]).decode("utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=Path, required=True, help="llama.cpp's models/ggml-vocab-llama-bpe.gguf")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(GGUF_SHAPES))
    p.add_argument("--mix", default="Q4_0-all", choices=MIXES, help="quantisation mix (default %(default)s)")
    p.add_argument("--std", type=float, default=0.02, help="the weights' standard deviation (default 0.02)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--untied", action="store_true", help="an LM head of its own (the CUDA tests' model)")
    p.add_argument("--offset-codes", action="store_true",
                   help="codes 0..15 (mean -d/2): greedy output repeats one token, drafts always hit")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    write_bench_gguf(args.vocab, args.out, GGUF_SHAPES[args.shape], std=args.std, seed=args.seed,
                     untied=args.untied, offset=args.offset_codes, mix=args.mix)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
