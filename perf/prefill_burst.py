"""Requests that arrive together, engine-direct: time to first token of a burst of N requests when a step's
prefill budget goes to every waiting prompt (``max_prefills_per_step=0``) or to one (``1``, the behaviour
before issue 25), two engines on the same folder, bursts alternating between them.

Two bursts: the same prompt N times after it was served once (prefix reuse: each request computes its last
two tokens, so a step's budget holds them all), and N distinct prompts (the budget holds about one and a half).

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m perf.prefill_burst --model-dir .cache/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


async def burst(engine: Any, prompts: list[list[int]], tag: str) -> list[float]:
    """TTFT (s) of each prompt, all sent at once."""
    from engine.types import SamplingParams

    async def one(i: int, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True),
                                       f"{tag}-{i}"):
            return time.perf_counter() - t0
        return float("nan")

    return list(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    engines = {label: AsyncEngine.from_model_dir(args.model_dir, EngineConfig(
        max_batch=args.n, intra_op_threads=args.threads, max_prefills_per_step=value))
        for label, value in (("mixed", 0), ("one", 1))}
    tok = engines["mixed"].tokenizer
    texts = [f"Request {i}: describe a different city, number {i * 7919 % 1000}, in detail please." * 4
             for i in range(args.n * args.rounds)]
    results: dict[str, dict[str, list[float]]] = {label: {"same": [], "distinct": []} for label in engines}
    try:
        for label, engine in engines.items():  # warm-up, and the shared prompt's prefix into a slot
            await burst(engine, [tok.encode(texts[0])], f"warm-{label}")
        for rnd in range(args.rounds):
            distinct = [tok.encode(t) for t in texts[rnd * args.n:(rnd + 1) * args.n]]
            same = [tok.encode(texts[0])] * args.n
            for label in (list(engines) if rnd % 2 == 0 else list(engines)[::-1]):
                for kind, prompts in (("same", same), ("distinct", distinct)):
                    if kind == "same":  # the shared prompt served once just before: its KV waits in a slot
                        await burst(engines[label], same[:1], f"{label}-prime-{rnd}")
                    ttft = await burst(engines[label], prompts, f"{label}-{kind}-{rnd}")
                    results[label][kind].append(statistics.median(ttft))
                    print(f"[burst] round {rnd} {label:5s} {kind:8s} TTFT p50 {statistics.median(ttft) * 1e3:7.1f} ms "
                          f"max {max(ttft) * 1e3:7.1f} ms", file=sys.stderr)
    finally:
        for engine in engines.values():
            engine.shutdown()
    summary = {kind: {label: statistics.median(results[label][kind]) * 1e3 for label in engines}
               for kind in ("same", "distinct")}
    for kind, row in summary.items():
        ratios = [o / m for o, m in zip(results["one"][kind], results["mixed"][kind])]
        row["one_over_mixed_median"] = statistics.median(ratios)
        row["one_over_mixed_rounds"] = ratios
    return {"n": args.n, "rounds": args.rounds, "p50_ttft_ms": summary, "per_round_s": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    print(json.dumps(report["p50_ttft_ms"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
