"""Whether prompt-lookup draft checks pay, counted rather than timed (a shared machine's load cannot move it).

1. The engine serves REQUESTS of compare_llama_server's requests (100-word prompts, distinct or one shared, 128
   tokens, seeded) one at a time; every decode run and every draft check (by its length S) is counted.
2. A bare loop (perf.ceiling) times a run of S tokens with S logits against a one-token run, single runs
   interleaved, medians: what a check of S costs in decode steps.
3. Tokens per decode step's worth of runs: above 1, the drafts paid for themselves.

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m perf.spec_cost --temperature 1 --requests 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from perf.compare_llama_server import prompt_of


async def count_runs(model: Path, requests: int, temperature: float, distinct: bool, threads: int,
                     max_tokens: int = 128, words: int = 100) -> dict[str, Any]:
    """Serve ``requests`` one at a time; ``{"tokens", "decode", "checks": {S: count}, "drafted", "accepted"}``."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.types import SamplingParams

    engine = await asyncio.to_thread(AsyncEngine.from_model_dir, model, EngineConfig(intra_op_threads=threads))
    runner = engine._core.runner  # NOTE(bench): counted by wrapping the core's runner (engine internals)
    counts: Counter[str] = Counter()
    checks: Counter[int] = Counter()
    decode, verify = runner.decode, runner.verify

    def counted_decode(slots, *args, **kwargs):
        counts["decode"] += 1
        return decode(slots, *args, **kwargs)

    def counted_verify(slot, token_ids, start):
        checks[len(token_ids)] += 1
        return verify(slot, token_ids, start)

    runner.decode, runner.verify = counted_decode, counted_verify
    tokens = 0
    try:
        for i in range(requests):
            text = prompt_of(i if distinct else 0, words, distinct, 999)
            ids = engine.tokenizer.encode(engine.chat_template.render([{"role": "user", "content": text}]))
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=i)
            async for out in engine.generate(ids, params, f"spec-cost-{i}"):
                tokens += len(out.token_ids)
        extra = engine.stats().extra
    finally:
        engine.shutdown()
    return {"tokens": tokens, "decode": counts["decode"], "checks": dict(sorted(checks.items())),
            "drafted": extra["spec_draft_tokens_total"], "accepted": extra["spec_accepted_tokens_total"]}


def check_costs(model: Path, sizes: list[int], threads: int, rounds: int, position: int = 200,
                stop_spinning: bool | None = None) -> dict[int, float]:
    """Median time of a run of S tokens (S logits kept) over a one-token run's, single runs interleaved."""
    from perf.ceiling import BareLoop

    loop = BareLoop(model, 1, threads, position + 64, stop_spinning=stop_spinning)
    loop.prefill([(17 * i + 100) % 40000 + 100 for i in range(position)])
    ort, io = loop.ort, loop.io
    bound = {}
    for size in sorted({1, *sizes}):
        binding = loop.session.io_binding()
        ids = np.full((1, size), 5, np.int64)
        pos = np.arange(position, position + size, dtype=np.int64)[None]
        mask = np.ones((1, position + size), np.int64)
        keep = np.array([size], np.int64)
        logits = np.zeros((1, size, io.vocab_size), np.float32)
        binding.bind_cpu_input(io.input_ids, ids)
        binding.bind_cpu_input(io.position_ids, pos)
        binding.bind_cpu_input(io.attention_mask, mask)
        binding.bind_ortvalue_input("logits_to_keep", ort.OrtValue.ortvalue_from_numpy(keep))
        binding.bind_output(io.logits, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        loop._bind_kv(binding, 0, 1)
        bound[size] = (binding, (ids, pos, mask, keep, logits))  # NOTE(bench): the arrays outlive the binding
    times: dict[int, list[float]] = {size: [] for size in bound}
    for _ in range(rounds):
        for size, (binding, _) in bound.items():
            t0 = time.perf_counter()
            loop.session.run_with_iobinding(binding)
            times[size].append(time.perf_counter() - t0)
    base = statistics.median(times[1])
    return {size: statistics.median(t) / base for size, t in times.items()}


def tokens_per_step(counts: dict[str, Any], costs: dict[int, float]) -> float:
    """Tokens per decode step's worth of runs (a check of S costs ``costs[S]``; sizes not timed: interpolated)."""
    known = sorted(costs)
    units = counts["decode"] + sum(n * float(np.interp(s, known, [costs[k] for k in known]))
                                   for s, n in counts["checks"].items())
    return counts["tokens"] / units


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model folder (default: the pulled default model)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--same-prompt", action="store_true", help="one prompt for all (compare_llama_server's t0-same)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cost-rounds", type=int, default=60)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from engine.builder.pull import DEFAULT_MODEL, resolve_model

    model = resolve_model(args.model or DEFAULT_MODEL)
    counts = asyncio.run(count_runs(model, args.requests, args.temperature, not args.same_prompt, args.threads))
    costs = check_costs(model, [2, 3, 5, 9], args.threads, args.cost_rounds)
    rate = tokens_per_step(counts, costs)
    print(f"{counts['tokens']} tokens: {counts['decode']} decode runs, checks by length {counts['checks']}, "
          f"{counts['accepted']} of {counts['drafted']} drafted tokens kept")
    print("a check of S tokens costs " + ", ".join(f"S={s}: {c:.2f}" for s, c in sorted(costs.items()) if s > 1)
          + " decode steps")
    print(f"tokens per decode step's worth: {rate:.3f} ({'drafts pay' if rate > 1 else 'drafts cost'})")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "counts": counts,
                                         "check_costs": costs, "tokens_per_step": rate}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
