"""Can several rows' draft checks run as one model run, and what would it save? (issue 48)

A draft check is a run of S = 1 + len(draft) tokens after the row's past. ONNX Runtime's GroupQueryAttention takes
S > 1 with a past only at batch 1 (its shared helper, so every EP: "batch_size must be 1 when sequence_length > 1 and
past context is given"); the engine checks each row alone. This probe, on the engine's own graph and session options
(a bare loop over host KV, perf.ceiling.BareLoop):

1. runs ``[k, S]`` after a past and records what ONNX Runtime answers (the refusal, or the logits);
2. times, in interleaved rounds (medians), k lone checks ``[1, S]`` after a past of P tokens, one decode step of the
   k rows ``[k, 1]``, a lone decode step ``[1, 1]``, and S tokens of k rows as GroupQueryAttention's first prompt
   ``[k, S]`` (no past: the one S > 1 shape it batches) against k such runs alone: what sharing one run saves at
   this shape, i.e. the most a batched check could gain over k lone ones;
3. prints each in lone decode steps, and tokens per decode step's worth of time for k streams with drafts checked
   row by row (at acceptance ``a`` per token) against plain batched decoding.

    ORTSERVE_CACHE_DIR=.cache flock /work/locks/cpu-bench.lock .venv/bin/python -m perf.verify_rows \\
        --model .cache/qwen2.5-coder-1.5b --rows 4 --tokens 5 --past 256 --json docs/perf/verify-rows.json

Findings: docs/perf/speculative.md ("Checks of several rows").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


class _Runs:
    """The bound runs of the probe over one BareLoop of 2k rows: rows [0, k) hold a past of P tokens, rows [k, 2k)
    take the first-prompt runs (which write KV from position 0)."""

    def __init__(self, model: Path, rows: int, tokens: int, past: int, threads: int) -> None:
        from perf.ceiling import BareLoop

        self.k, self.s, self.p = rows, tokens, past
        self.loop = BareLoop(model, 2 * rows, threads, past + tokens + 8)
        self.loop.prefill([(17 * i + 100) % 4000 + 100 for i in range(past)])
        self._keep: list[Any] = []  # NOTE(bench): IOBinding keeps no reference to the arrays it binds

    def bind(self, lo: int, batch: int, size: int, start: int) -> Any:
        """A binding of ``[batch, size]`` tokens at ``start`` in rows ``[lo, lo + batch)``, every position's logits."""
        loop, io = self.loop, self.loop.io
        binding = loop.session.io_binding()
        ids = np.full((batch, size), 5, np.int64)
        pos = np.broadcast_to(np.arange(start, start + size, dtype=np.int64), (batch, size)).copy()
        mask = np.ones((batch, start + size), np.int64)  # as wide as past + S: GQA's total_sequence_length
        keep = np.array([size], np.int64)
        logits = np.zeros((batch, size, io.vocab_size), np.float32)
        binding.bind_cpu_input(io.input_ids, ids)
        if io.position_ids:
            binding.bind_cpu_input(io.position_ids, pos)
        binding.bind_cpu_input(io.attention_mask, mask)
        if loop.keep_last:
            binding.bind_ortvalue_input("logits_to_keep", loop.ort.OrtValue.ortvalue_from_numpy(keep))
        binding.bind_output(io.logits, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        loop._bind_kv(binding, lo, lo + batch)
        self._keep.append((ids, pos, mask, keep, logits))
        return binding

    def run(self, binding: Any) -> None:
        self.loop.session.run_with_iobinding(binding)


def refusal(model: Path, rows: int, tokens: int, past: int, threads: int) -> str | None:
    """What ONNX Runtime says to ``[rows, tokens]`` after a past (in a session of its own): None when it runs."""
    runs = _Runs(model, rows, tokens, past, threads)
    try:
        runs.run(runs.bind(0, rows, tokens, past))
    except Exception as exc:  # noqa: BLE001 - the message is the finding
        return f"{type(exc).__name__}: {exc}"
    return None


def measure(model: Path, rows: int, tokens: int, past: int, threads: int, rounds: int) -> dict[str, Any]:
    """Median seconds of each kind of run (interleaved rounds), and the same in lone decode steps."""
    runs = _Runs(model, rows, tokens, past, threads)
    k, s, p = rows, tokens, past
    kinds = {
        "decode_1": [runs.bind(0, 1, 1, p)],
        "decode_k": [runs.bind(0, k, 1, p)],
        "checks_alone": [runs.bind(r, 1, s, p) for r in range(k)],  # the engine's way: one run per row
        "prompt_alone": [runs.bind(k + r, 1, s, 0) for r in range(k)],
        "prompt_k": [runs.bind(k, k, s, 0)],
    }
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(rounds):
        for name, bindings in kinds.items():
            t0 = time.perf_counter()
            for binding in bindings:
                runs.run(binding)
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(t) for name, t in times.items()}
    step = median["decode_1"]
    in_steps = {name: round(t / step, 3) for name, t in median.items()}
    # the MatMul sharing one run buys at [k, S]: the most a batched check could save over k lone checks
    shared = median["prompt_alone"] - median["prompt_k"]
    batched = max(median["checks_alone"] - shared, median["checks_alone"] / k)
    in_steps["checks_batched_estimate"] = round(batched / step, 3)
    return {"seconds": {n: round(t, 5) for n, t in median.items()}, "decode_steps": in_steps,
            "rounds": rounds, "times": {n: [round(x, 5) for x in t] for n, t in times.items()}}


def tokens_per_time(acceptance: float, draft: int, rows: int, costs: dict[str, float]) -> dict[str, float]:
    """Tokens per lone decode step's worth of time for ``rows`` streams: plain batched decoding, checks row by row
    (``checks_alone``), and an ideal batched check (``checks_batched_estimate``); drafts of ``draft`` tokens each kept
    with probability ``acceptance`` (prompt lookup: free to make)."""
    expected = sum(acceptance ** i for i in range(draft + 1))
    return {"plain": round(rows / costs["decode_k"], 3),
            "checks_alone": round(rows * expected / costs["checks_alone"], 3),
            "checks_batched": round(rows * expected / costs["checks_batched_estimate"], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a model folder (ortserve's conversion)")
    ap.add_argument("--rows", type=int, default=4, help="k: rows that check a draft in the same step")
    ap.add_argument("--tokens", type=int, default=5, help="S: tokens of one check (the last token and S - 1 drafted)")
    ap.add_argument("--past", type=int, default=256, help="P: tokens each row holds before the check")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--acceptance", type=float, default=0.7, help="per-token acceptance for the tokens-per-time line")
    ap.add_argument("--json", type=Path, help="write the findings here too")
    args = ap.parse_args(argv)
    found: dict[str, Any] = {"model": str(args.model), "rows": args.rows, "tokens": args.tokens, "past": args.past,
                             "threads": args.threads}
    print(f"[verify_rows] [{args.rows}, {args.tokens}] after a past of {args.past}...", file=sys.stderr, flush=True)
    found["batched_check"] = refusal(args.model, args.rows, args.tokens, args.past, args.threads) or "runs"
    print(f"[verify_rows] ONNX Runtime: {found['batched_check']}", file=sys.stderr, flush=True)
    found.update(measure(args.model, args.rows, args.tokens, args.past, args.threads, args.rounds))
    found["tokens_per_decode_step"] = tokens_per_time(args.acceptance, args.tokens - 1, args.rows,
                                                      found["decode_steps"])
    found["acceptance"] = args.acceptance
    text = json.dumps(found, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
