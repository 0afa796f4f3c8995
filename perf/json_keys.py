"""What the repeated-key guard of constrained decoding (engine.json_keys) costs per token, with it and without.

1. Mask step in process: fill + accept per token of JSON documents (open objects with many keys, closed
   schema objects, arrays of objects), teacher-forced through the engine's StructuredOutputBackend on the
   model's tokenizer, with the key tracker and without (the grammar alone); microseconds per token.
2. Engine-direct TPOT on the model: json_object requests (a prompt that asks for many keys, temperature 1,
   seeded), batch 1 and 4, rounds interleaved (order flips each round); the figure is the median over rounds of
   TPOT without / TPOT with (1.0 = the guard is free). "Without" is the lab switch below, never a product one.

    ORTSERVE_CACHE_DIR=~/.cache/ortserve .venv/bin/python -m perf.json_keys --rounds 4 \\
        --json docs/perf/json-keys.json --plot docs/perf/json-keys.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

DOCS = [
    json.dumps({f"X-Header-{i}": f"value {i}" for i in range(40)}, separators=(",", ":")),
    json.dumps({"rows": [{"id": i, "name": f"n{i}", "tags": ["a", "b"], "ok": i % 2 == 0} for i in range(12)],
                "total": 12, "meta": {"ContentType": "text/plain", "page": 1}}, separators=(",", ":")),
]
QUESTION = ("List 30 HTTP response headers with example values as one flat JSON object, for example "
            '{"ContentType":"text/html","ContentLength":"512","CacheControl":"no-cache", ...}')


def _tracker(backend: Any, on: bool, vocab: Any) -> None:
    """Lab switch: constraints made from now on have the key tracker (``on``) or the grammar alone."""
    backend._vocab = vocab if on else None


def measure_mask(model_dir: Path, reps: int) -> dict:
    from engine.model_loader import read_model_folder
    from engine.structured_output import StructuredOutputBackend
    from engine.types import StructuredOutput

    folder = read_model_folder(model_dir)
    backend = StructuredOutputBackend(folder.tokenizer.hf, folder.tokenizer.vocab_size, folder.eos_token_ids)
    out: dict[str, Any] = {}
    try:
        backend.start().result()
        vocab = backend._vocab
        for index, doc in enumerate(DOCS):
            token_ids = folder.tokenizer.hf.encode(doc).ids
            spec = StructuredOutput("json_object")
            bitmask = backend.allocate_bitmask(1)
            per_arm: dict[str, list[float]] = {"with": [], "without": []}
            for rep in range(reps):
                for arm in (("with", "without") if rep % 2 == 0 else ("without", "with")):
                    _tracker(backend, arm == "with", vocab)
                    constraint = backend.constraint_sync(spec)
                    t0 = time.perf_counter()
                    for token_id in token_ids:
                        constraint.fill(bitmask, 0)
                        assert constraint.accept(token_id), constraint.error
                    per_arm[arm].append((time.perf_counter() - t0) / len(token_ids) * 1e6)
            _tracker(backend, True, vocab)
            w, wo = statistics.median(per_arm["with"]), statistics.median(per_arm["without"])
            out[f"doc{index}"] = {"tokens": len(token_ids), "us_per_token_with": w, "us_per_token_without": wo,
                                  "extra_us_per_token": w - wo, "runs": per_arm}
            print(f"mask step, doc {index} ({len(token_ids)} tokens): {wo:.1f} us/token grammar alone, "
                  f"{w:.1f} with the key tracker (+{w - wo:.1f} us)", flush=True)
    finally:
        backend.shutdown()
    return out


async def _run(engine: Any, prompt: list[int], batch: int, max_tokens: int, seed: int) -> dict:
    from engine.types import SamplingParams, StructuredOutput

    async def one(k: int) -> tuple[float | None, str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 100 + k,
                                structured=StructuredOutput("json_object"))
        stamps, text, n = [], [], 0
        async for out in engine.generate(prompt, params, f"keys-{seed}-{batch}-{k}-{time.monotonic_ns()}"):
            stamps.append((time.perf_counter(), len(out.token_ids)))
            text.append(out.text)
        n = sum(c for _, c in stamps)
        tpot = (stamps[-1][0] - stamps[0][0]) / (n - stamps[0][1]) if n > stamps[0][1] else None
        return tpot, "".join(text)

    results = await asyncio.gather(*[one(k) for k in range(batch)])
    tpots = [t * 1e3 for t, _ in results if t is not None]
    return {"tpot_ms": statistics.median(tpots) if tpots else None, "texts": [t for _, t in results]}


def measure_tpot(model_dir: Path, args: argparse.Namespace) -> dict:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    engine = AsyncEngine.from_model_dir(model_dir, EngineConfig(max_batch=max(args.batches), prefill_chunk=256,
                                                                speculative_tokens=0))
    try:
        backend = engine.structured
        backend.start().result()
        vocab = backend._vocab
        prompt = engine.tokenizer.encode(engine.chat_template.render([{"role": "user", "content": QUESTION}]))
        asyncio.run(_run(engine, prompt, 1, 16, seed=999))  # warm-up: compile, wake every path
        rounds = []
        for r in range(args.rounds):
            entry: dict[str, Any] = {"round": r}
            for batch in args.batches:
                for arm in (("with", "without") if r % 2 == 0 else ("without", "with")):
                    _tracker(backend, arm == "with", vocab)
                    entry[f"{arm}_b{batch}"] = asyncio.run(_run(engine, prompt, batch, args.output_tokens, seed=r))
                _tracker(backend, True, vocab)
                w, wo = entry[f"with_b{batch}"]["tpot_ms"], entry[f"without_b{batch}"]["tpot_ms"]
                entry[f"ratio_b{batch}"] = wo / w
                print(f"round {r} batch {batch}: {wo:.2f} ms/token without, {w:.2f} with, ratio {wo / w:.3f}",
                      flush=True)
            rounds.append(entry)
    finally:
        engine.shutdown()
    summary = {f"b{b}": {"ratio_median": statistics.median(e[f"ratio_b{b}"] for e in rounds),
                         "ratios": [e[f"ratio_b{b}"] for e in rounds],
                         "with_tpot_ms_median": statistics.median(e[f"with_b{b}"]["tpot_ms"] for e in rounds),
                         "without_tpot_ms_median": statistics.median(e[f"without_b{b}"]["tpot_ms"] for e in rounds)}
               for b in args.batches}
    return {"rounds": rounds, "summary": summary, "sample": rounds[-1][f"with_b{args.batches[0]}"]["texts"][0]}


def plot(results: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_mask, ax_tpot = fig.subplots(1, 2)
    docs = sorted(results["mask"])
    x = range(len(docs))
    ax_mask.bar([i - 0.2 for i in x], [results["mask"][d]["us_per_token_without"] for d in docs], 0.4,
                label="grammar alone")
    ax_mask.bar([i + 0.2 for i in x], [results["mask"][d]["us_per_token_with"] for d in docs], 0.4,
                label="grammar + key tracker")
    ax_mask.set_xticks(list(x), ["40 open keys", "arrays of objects"])
    ax_mask.set_ylabel("mask fill + accept (us per token)")
    ax_mask.set_title("mask step, in process")
    ax_mask.legend(fontsize=8)
    summary = results["tpot"]["summary"]
    batches = sorted(int(k[1:]) for k in summary)
    for i, b in enumerate(batches):
        ratios = summary[f"b{b}"]["ratios"]
        ax_tpot.plot([i] * len(ratios), ratios, "o", color="tab:blue", alpha=0.5,
                     label="one round (interleaved pair)" if i == 0 else None)
        median = summary[f"b{b}"]["ratio_median"]
        ax_tpot.plot([i - 0.2, i + 0.2], [median, median], color="tab:orange", lw=3,
                     label="median of rounds" if i == 0 else None)
        ax_tpot.annotate(f"{median:.3f}x", (i + 0.22, median), va="center")
    ax_tpot.axhline(1.0, color="grey", lw=0.8)
    ax_tpot.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax_tpot.set_xlim(-0.6, len(batches) - 0.4)
    ax_tpot.set_ylabel("TPOT without / TPOT with (1.0 = free)")
    ax_tpot.set_title("json_object decode, engine-direct")
    ax_tpot.legend(fontsize=8)
    fig.suptitle(f"repeated-key guard, {results['model']} on CPU (shared 2-core machine)")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20, help="mask-step repetitions per document and arm")
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4])
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    from engine.builder import pull_model

    model_dir = pull_model(args.model, progress=False)
    results = {"model": args.model, "mask": measure_mask(model_dir, args.reps), "tpot": measure_tpot(model_dir, args)}
    for b, s in results["tpot"]["summary"].items():
        print(f"{b}: TPOT {s['without_tpot_ms_median']:.2f} ms without, {s['with_tpot_ms_median']:.2f} ms with; "
              f"ratio median {s['ratio_median']:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
