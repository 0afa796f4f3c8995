"""Does a whole model's decode row depend on how many rows run with it? (issue 44; perf/kernel_rows.py does one node)

A model folder's greedy run of a chat prompt, each decode step run twice: the row alone (M=1, a lone decode step) and
the same row beside another request's row (M=2, a decode batch of two), from identical KV. Per step it records the
largest change of a top-5 token's log-probability and, where the two argmaxes differ, each side's gap between the two
tokens: what the near-tie bound of tests/greedy_close.py must cover. ``--qemu-cpu MODEL`` runs it again under
``qemu-x86_64 -cpu MODEL`` (Debian's qemu-user; EPYC-Rome: AVX2 without AVX-512), about 100x slower. Findings:
docs/perf/kernel-rows.md.

    python -m perf.model_rows --model .cache/smollm2-135m-instruct --steps 16 --qemu-cpu EPYC-Rome
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

# (the request measured, the request beside it)
PROMPTS = (("Name 3 animals that live in the sea.", "Write a haiku about the sea."),
           ("What is 12 times 12?", "List the days of the week."))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def probe(model_dir: Path, num_steps: int) -> dict:
    """{"steps": [{prompt, step, top5_max_diff, margin_alone[, flip]}], "max_top5_diff": float, "num_flips": int}"""
    from engine.config import EngineConfig
    from engine.kv_cache import HostKVAllocator, KVCache, KVShape
    from engine.model_loader import check_graph, create_session, read_model_folder
    from engine.runner import Runner

    folder = read_model_folder(model_dir)
    session, _ = create_session(folder, EngineConfig(max_batch=2, prefill_chunk=128))
    io = check_graph(folder, session)
    length = 256

    def runner() -> Runner:
        shape = KVShape(folder.num_layers, 2, folder.num_kv_heads, length, folder.head_size, io.kv_dtype)
        return Runner(session, io, KVCache(shape, HostKVAllocator()), prefill_chunk=128, max_position=length)

    def chat(text: str) -> list[int]:
        return folder.tokenizer.encode(folder.chat_template.render([{"role": "user", "content": text}]))

    steps = []
    for i, (asked, beside) in enumerate(PROMPTS):
        p, q = chat(asked), chat(beside)
        alone, paired = runner(), runner()  # the same KV in slot 0 of both; slot 1 of `paired` holds `beside`
        token = int(np.argmax(alone.prefill(0, p, 0)))
        paired.prefill(0, p, 0)
        other = int(np.argmax(paired.prefill(1, q, 0)))
        for step in range(num_steps):
            x = _log_softmax(alone.decode([0], [token], [len(p) + step])[0])
            rows = paired.decode([0, 1], [token, other], [len(p) + step, len(q) + step])
            y, other = _log_softmax(rows[0]), int(np.argmax(rows[1]))
            top = set(np.argsort(-x)[:5]) | set(np.argsort(-y)[:5])
            ranked = np.sort(x)[::-1]
            record = {"prompt": i, "step": step, "top5_max_diff": float(max(abs(x[t] - y[t]) for t in top)),
                      "margin_alone": float(ranked[0] - ranked[1])}
            a, b = int(np.argmax(x)), int(np.argmax(y))
            if a != b:
                record["flip"] = {"alone_gap": float(x[a] - x[b]), "paired_gap": float(y[b] - y[a])}
            steps.append(record)
            token = a  # both follow the lone run
    return {"steps": steps, "max_top5_diff": max(s["top5_max_diff"] for s in steps),
            "num_flips": sum("flip" in s for s in steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a model folder")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per prompt")
    parser.add_argument("--qemu-cpu", help="also run under qemu-x86_64 -cpu MODEL (e.g. EPYC-Rome: AVX2, no AVX-512)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the probe alone, JSON on stdout
    args = parser.parse_args()
    if args.inner:
        print(json.dumps(probe(args.model, args.steps)))
        return
    results = {"model": str(args.model), "native": probe(args.model, args.steps)}
    if args.qemu_cpu:
        out = subprocess.run(["qemu-x86_64", "-cpu", args.qemu_cpu, sys.executable, "-m", "perf.model_rows", "--inner",
                              "--model", str(args.model), "--steps", str(args.steps)],
                             capture_output=True, text=True, check=True)
        results[f"qemu {args.qemu_cpu}"] = json.loads(out.stdout.strip().splitlines()[-1])
    text = json.dumps(results, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
