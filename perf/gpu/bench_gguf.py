"""The GPU bench model as a GGUF file: a Llama-3.2-1B shape with random Q4_0 weights at a small scale (finite float16
logits, unlike ``engine.builder.build_synthetic``'s) and the real Llama 3 vocabulary, written with gguf-py in seconds.
The same file serves llama.cpp's llama-server and, through ``ortserve convert``, ortserve (issue 38).

The vocabulary comes from llama.cpp's ``models/ggml-vocab-llama-bpe.gguf`` (tokenizer fields only, no tensors) and
gguf-py from the same sources (llama-cpp-python's sdist vendors both; ``perf/gpu/peer_sources.sh`` packs them).

    python -m perf.gpu.bench_gguf --vocab ggml-vocab-llama-bpe.gguf --out bench-1b.gguf [--shape llama-3.2-1b] [--untied]

With centred codes (the default) greedy output varies and prompt-lookup drafts miss; ``--offset-codes`` (codes 0..15,
every weight's mean -d/2, issue 38's first bench file) makes every prompt's greedy output one repeated token, so drafts
always hit. ``--untied`` gives the LM head weights of its own (the CUDA engine tests' model).

Weights: every linear and the tied embedding as Q4_0 blocks (an fp16 scale d and 32 4-bit codes q, value
``d * (q - 8)``) with codes uniform in 1..15 (centred) and ``d = std / 4.32`` (their standard deviation), so each weight
has about ``std`` (0.02 by default, as a trained model's initialization); norms are ones. Residual and logits stay
within a few units, so float16 activations never overflow.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from perf.gpu.shapes import SHAPES

Q4_0_BLOCK = 32  # weights per block
Q4_0_BYTES = 18  # fp16 scale + 16 bytes of codes
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


def write_bench_gguf(vocab_path: Path, out: Path, shape: dict[str, int], std: float = 0.02, seed: int = 0,
                     context_length: int = 8192, untied: bool = False, offset: bool = False) -> Path:
    """Write the bench GGUF (see the module docstring); returns ``out``. ``untied``: an LM head of its own (random
    like the rest) instead of the embedding's: greedy output is then varied (tied, a random model's logits favour the
    token just read, so its greedy output repeats one token and prompt-lookup drafts always hit)."""
    import gguf

    vocab = gguf.GGUFReader(str(vocab_path))
    h, layers, heads = shape["hidden_size"], shape["num_layers"], shape["num_heads"]
    kv_heads, ffn, n_vocab = shape["num_kv_heads"], shape["intermediate_size"], shape["vocab_size"]
    head = h // heads
    tokens = vocab.fields["tokenizer.ggml.tokens"]
    if len(tokens.data) != n_vocab:
        raise ValueError(f"{vocab_path} holds {len(tokens.data)} tokens, the shape {n_vocab}")
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("ortserve-bench-llama-3.2-1b-random")
    w.add_block_count(layers)
    w.add_context_length(context_length)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    # the tokenizer, field by field as llama.cpp wrote it
    w.add_tokenizer_model(_string(vocab, "tokenizer.ggml.model"))
    w.add_tokenizer_pre(_string(vocab, "tokenizer.ggml.pre"))
    w.add_token_list([_string_at(tokens, i) for i in range(len(tokens.data))])
    types = vocab.fields["tokenizer.ggml.token_type"]
    w.add_token_types([int(types.parts[i][0]) for i in types.data])
    merges = vocab.fields["tokenizer.ggml.merges"]
    w.add_token_merges([_string_at(merges, i) for i in range(len(merges.data))])
    w.add_bos_token_id(_int(vocab, "tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(_int(vocab, "tokenizer.ggml.eos_token_id"))
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)
    q4 = gguf.GGMLQuantizationType.Q4_0

    def linear(name: str, rows: int, cols: int) -> None:  # GGUF shapes are [cols, rows] (ne0 first)
        w.add_tensor(name, q4_0_blocks(rng, rows, cols, std, offset), raw_dtype=q4)  # (its byte shape)

    linear("token_embd.weight", n_vocab, h)  # tied: llama.cpp and the converter use it as the LM head too
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    if untied:
        linear("output.weight", n_vocab, h)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        linear(p + "attn_q.weight", heads * head, h)
        linear(p + "attn_k.weight", kv_heads * head, h)
        linear(p + "attn_v.weight", kv_heads * head, h)
        linear(p + "attn_output.weight", h, heads * head)
        linear(p + "ffn_gate.weight", ffn, h)
        linear(p + "ffn_up.weight", ffn, h)
        linear(p + "ffn_down.weight", h, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _string(reader, key: str) -> str:
    return _string_at(reader.fields[key], 0)


def _string_at(field, i: int) -> str:
    return bytes(field.parts[field.data[i]]).decode("utf-8")


def _int(reader, key: str) -> int:
    field = reader.fields[key]
    return int(field.parts[field.data[0]][0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=Path, required=True, help="llama.cpp's models/ggml-vocab-llama-bpe.gguf")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--std", type=float, default=0.02, help="the weights' standard deviation (default 0.02)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--untied", action="store_true", help="an LM head of its own (the CUDA tests' model)")
    p.add_argument("--offset-codes", action="store_true",
                   help="codes 0..15 (mean -d/2): greedy output repeats one token, drafts always hit")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    write_bench_gguf(args.vocab, args.out, SHAPES[args.shape], std=args.std, seed=args.seed, untied=args.untied,
                     offset=args.offset_codes)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
