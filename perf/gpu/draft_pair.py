"""A target and draft model pair with planted agreement, as GGUF files of real shapes (issue 48 on the GPU).

The real pair (Qwen2.5-Coder-1.5B drafted by its 0.5B sibling) cannot reach the GPU machine in one session (1.5 GB of
GGUF in 44 MB calls), and random weights make a draft that never agrees. These files have the real pair's shapes
(``qwen2.5-1.5b`` and ``qwen2.5-0.5b`` in ``GGUF_SHAPES``), the Qwen2 vocabulary and llama.cpp's Q4_K_M mix for every
layer, so each decode step, draft step and verification costs what the real one costs, while their greedy output is
known:

- the embedding (F16) puts token ``x`` at ``F(x)``, ``K`` random frequencies ``w_k`` as ``(cos w_k x, sin w_k x)``
  pairs; the LM head (its own, Q8_0) puts token ``y`` at ``F(y - 1)``, so ``<head_y, F(x)> = sum_k cos(w_k (x + 1 -
  y))``, ``K`` at ``y = x + 1`` and about ``sqrt(K / 2)`` anywhere else;
- the layers' weights are random and small (``std`` 0.002): the residual stream stays the embedding, so the target's
  greedy answer counts up from the prompt's last token id (``x, x + 1, x + 2, ...``), whatever came before it;
- the draft is built the same way, except that for a fixed random fraction ``1 - agree`` of token ids its embedding
  holds ``F(x + 1)``: after those tokens it proposes ``x + 2``, a miss, with full confidence (the worst case for a
  confidence threshold). Along an answer the misses fall independently, each position kept with probability
  ``agree``.

Both servers read the same two files: ortserve through its converter, llama.cpp's llama-server as they are. What the
bench then measures is the machinery (draft steps, batched verification, scheduling) at a known acceptance, not a
real model's acceptance, which docs/perf/speculative.md measures on the CPU with the real pair.

    python -m perf.gpu.draft_pair --vocab ggml-vocab-qwen2.gguf --out-dir /root/peer/pair [--agree 0.7 0]
    python -m perf.gpu.draft_pair --check /root/peer/pair/target.gguf 198   # the planted answer after token 198
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from perf.gpu.bench_gguf import write_bench_gguf
from perf.gpu.shapes import GGUF_SHAPES

FREQUENCIES = 192  # K: 2K = 384 of the embedding's dimensions (the 0.5B has 896)
LAYER_STD = 0.002  # the layers' weights: small enough that the residual stream stays the embedding
FREQ_SEED = 1234  # the frequencies: shared by the pair (the draft must agree where it is meant to)
MISS_SEED = 4321  # which token ids the draft misses after


def frequencies(k: int = FREQUENCIES, seed: int = FREQ_SEED) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.0, np.pi, size=k)


def fourier_rows(ids: np.ndarray, hidden: int, freqs: np.ndarray) -> np.ndarray:
    """float32 ``[len(ids), hidden]``: ``F(id)`` in the first ``2K`` dimensions, zeros after."""
    out = np.zeros((len(ids), hidden), np.float32)
    phase = np.outer(ids.astype(np.float64), freqs)
    out[:, 0 : 2 * len(freqs) : 2] = np.cos(phase)
    out[:, 1 : 2 * len(freqs) : 2] = np.sin(phase)
    return out


def misses(n_vocab: int, agree: float, seed: int = MISS_SEED) -> np.ndarray:
    """bool ``[n_vocab]``: the token ids after which the draft proposes the wrong next token."""
    return np.random.default_rng(seed).random(n_vocab) >= agree


def write_pair_member(vocab: Path, out: Path, shape: str | dict, agree: float | None, seed: int,
                      num_frequencies: int = FREQUENCIES) -> Path:
    """The target (``agree`` None) or a draft agreeing on a fraction ``agree`` of token ids; ``shape``: a
    ``GGUF_SHAPES`` name or such a dict."""
    shape = GGUF_SHAPES[shape] if isinstance(shape, str) else shape
    hidden, n_vocab = shape["hidden_size"], shape["vocab_size"]
    freqs = frequencies(num_frequencies)
    missed = misses(n_vocab, agree) if agree is not None else np.zeros(n_vocab, bool)

    def embed_rows(start: int, n: int) -> np.ndarray:
        ids = np.arange(start, start + n)
        return fourier_rows(ids + missed[start : start + n], hidden, freqs)

    def head_rows(start: int, n: int) -> np.ndarray:
        return fourier_rows(np.arange(start, start + n) - 1, hidden, freqs)

    return write_bench_gguf(vocab, out, shape, std=LAYER_STD, seed=seed, mix="Q4_K_M", embed_rows=embed_rows,
                            head_rows=head_rows)


def check(gguf_path: Path, first: int, steps: int = 16) -> list[int]:
    """The greedy tokens after ``first`` as the file's embedding and head alone give them (the layers left out)."""
    from gguf import GGUFReader, quants

    r = GGUFReader(str(gguf_path))
    t = {x.name: x for x in r.tensors}
    emb, head = t["token_embd.weight"], t["output.weight"]
    emb_rows = np.asarray(emb.data, np.float32).reshape(-1, emb.shape[0])
    head_w = quants.dequantize(np.asarray(head.data), head.tensor_type).reshape(-1, head.shape[0])
    out, x = [], first
    for _ in range(steps):
        h = emb_rows[x] / np.sqrt(np.mean(emb_rows[x] ** 2))
        x = int(np.argmax(head_w @ h))
        out.append(x)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=Path, help="llama.cpp's models/ggml-vocab-qwen2.gguf (or any Qwen2 GGUF)")
    p.add_argument("--out-dir", type=Path)
    p.add_argument("--target-shape", default="qwen2.5-1.5b", choices=sorted(GGUF_SHAPES))
    p.add_argument("--draft-shape", default="qwen2.5-0.5b", choices=sorted(GGUF_SHAPES))
    p.add_argument("--agree", type=float, nargs="+", default=[0.7, 0.0],
                   help="one draft per fraction of token ids it agrees after (default: 0.7 and 0)")
    p.add_argument("--check", nargs=2, metavar=("GGUF", "TOKEN_ID"),
                   help="print the planted greedy answer after TOKEN_ID and exit")
    args = p.parse_args(argv)
    if args.check:
        print(check(Path(args.check[0]), int(args.check[1])))
        return 0
    if not (args.vocab and args.out_dir):
        p.error("--vocab and --out-dir are needed")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [("target", args.target_shape, None)] + [(f"draft-a{round(a * 100)}", args.draft_shape, a) for a in args.agree]
    for i, (name, shape, agree) in enumerate(jobs):
        t0 = time.perf_counter()
        out = write_pair_member(args.vocab, args.out_dir / f"{name}.gguf", shape, agree, seed=i)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
