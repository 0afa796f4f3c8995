"""One-off investigation behind the speculative-decoding defaults (docs/perf/engine-features.md), engine-direct:

1. draft length: engines with --speculative-tokens 0, 2, 4, 8, 12, 16 take the same greedy requests in turn
   (order rotating), copy and free text, single stream: decode tokens/s per k;
2. several streams: CONCURRENCY copy (then free-text) requests at once on engines without speculation, with
   drafts only while one request decodes (speculative_max_batch 1, the default) and with every stream checking
   its drafts in a run of its own (speculative_max_batch = CONCURRENCY): aggregate output tokens/s.

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m perf.spec_probe --rounds 3 --json out.json

Imports the engine (in-process); not part of the load-test harness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from bench.features import COPY_INSTRUCTION, FREE_PROMPTS, PASSAGES


async def _one(engine, ids: list[int], max_tokens: int, rid: str) -> tuple[int, float, float, list[int]]:
    """(tokens, seconds to the first token, seconds after it, token ids) of one greedy request."""
    from engine.types import SamplingParams

    t0 = time.perf_counter()
    first = None
    tokens: list[int] = []
    async for out in engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), rid):
        if out.token_ids and first is None:
            first = time.perf_counter()
        tokens += out.token_ids
    end = time.perf_counter()
    return len(tokens), (first or end) - t0, end - (first or end), tokens


def _decode_rate(n: int, after_first_s: float) -> float | None:
    return (n - 1) / after_first_s if n > 1 and after_first_s > 0 else None


async def main_async(args: argparse.Namespace) -> dict:
    from engine.async_engine import AsyncEngine
    from engine.builder import pull_model
    from engine.config import EngineConfig

    model = args.model or pull_model(progress=False)
    common = dict(provider="cpu", intra_op_threads=args.threads, max_model_len=1024, prefix_caching=False)
    ks = [int(k) for k in args.ks.split(",")]
    engines = {k: AsyncEngine.from_model_dir(model, EngineConfig(max_batch=2, speculative_tokens=k, **common))
               for k in ks}
    c = args.concurrency
    batch_engines = {
        "off": AsyncEngine.from_model_dir(model, EngineConfig(max_batch=c, speculative_tokens=0, **common)),
        "spec, alone only": AsyncEngine.from_model_dir(model, EngineConfig(max_batch=c, **common)),
        f"spec, up to {c} streams": AsyncEngine.from_model_dir(
            model, EngineConfig(max_batch=c, speculative_max_batch=c, **common)),
    }
    tok = engines[ks[0]].tokenizer
    template = engines[ks[0]].chat_template

    def ids(text: str) -> list[int]:
        return tok.encode(template.render([{"role": "user", "content": text}]))

    copy = [ids(COPY_INSTRUCTION + p) for p in PASSAGES]
    free = [ids(p) for p in FREE_PROMPTS]
    report: dict = {"settings": vars(args), "rounds": []}
    try:
        for eng in [*engines.values(), *batch_engines.values()]:  # warm-up, unrecorded
            await _one(eng, copy[0], 8, "warm")
        for rnd in range(args.rounds):
            entry: dict = {"round": rnd + 1, "single": {str(k): {"copy": [], "free": []} for k in ks},
                           "texts_equal": {str(k): {"copy": 0, "free": 0} for k in ks},
                           "batch": {"copy": {}, "free": {}}}
            for i in range(args.requests):
                for kind, prompt, max_tokens in (("copy", copy[i % len(copy)], 256),
                                                 ("free", free[i % len(free)], 128)):
                    order = ks[(i + rnd) % len(ks):] + ks[:(i + rnd) % len(ks)]
                    texts = {}
                    for k in order:
                        n, _, after, tokens = await _one(engines[k], prompt, max_tokens, f"s{rnd}-{i}-{k}")
                        entry["single"][str(k)][kind].append(_decode_rate(n, after))
                        texts[k] = tokens
                        await asyncio.sleep(args.pause)
                    for k in ks:
                        entry["texts_equal"][str(k)][kind] += texts[k] == texts[0] if 0 in texts else 0
            names = list(batch_engines)
            for kind, prompts, max_tokens in (("copy", copy, 256), ("free", free, 128)):
                for j in range(len(names)):
                    name = names[(j + rnd) % len(names)]
                    t0 = time.perf_counter()
                    results = await asyncio.gather(*[_one(batch_engines[name], prompts[(rnd * c + s) % len(prompts)],
                                                          max_tokens, f"b{rnd}-{s}") for s in range(c)])
                    entry["batch"][kind][name] = sum(r[0] for r in results) / (time.perf_counter() - t0)
                    await asyncio.sleep(args.pause)
            report["rounds"].append(entry)
            print(f"[spec_probe] round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for eng in [*engines.values(), *batch_engines.values()]:
            eng.shutdown()
    report["median"] = _medians(report, ks, list(batch_engines))
    return report


def _medians(report: dict, ks: list[int], batch_names: list[str]) -> dict:
    out: dict = {"single": {}, "batch": {}}
    for k in ks:
        for kind in ("copy", "free"):
            rates = [v for r in report["rounds"] for v in r["single"][str(k)][kind] if v is not None]
            out["single"].setdefault(str(k), {})[kind] = statistics.median(rates) if rates else None
        for kind in ("copy", "free"):
            out["single"][str(k)][f"{kind}_texts_equal"] = sum(r["texts_equal"][str(k)][kind] for r in report["rounds"])
    for kind in ("copy", "free"):
        out["batch"][kind] = {name: statistics.median(r["batch"][kind][name] for r in report["rounds"])
                              for name in batch_names}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.spec_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: the pulled default model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ks", default="0,2,4,8,12,16", help="--speculative-tokens values; 0 (the baseline) first")
    p.add_argument("--requests", type=int, default=4, help="copy and free requests per round")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pause", type=float, default=0.1)
    p.add_argument("--json", help="write the raw figures here")
    args = p.parse_args(argv)
    report = asyncio.run(main_async(args))
    med = report["median"]
    base = med["single"]["0"]
    n = args.requests * args.rounds
    for k, row in med["single"].items():
        print(f"k={k:>2}: copy {row['copy']:.1f} tok/s ({row['copy'] / base['copy']:.2f}x, same greedy text "
              f"{row['copy_texts_equal']}/{n}), free {row['free']:.1f} tok/s ({row['free'] / base['free']:.2f}x, "
              f"same text {row['free_texts_equal']}/{n})")
    for kind, rows in med["batch"].items():
        for name, value in rows.items():
            print(f"{args.concurrency} {kind} streams, {name}: {value:.1f} output tok/s "
                  f"({value / rows['off']:.2f}x)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
