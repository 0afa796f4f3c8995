"""Decode cost against --max-model-len on the CPU EP: does a longer context (KV buffers) slow every token?

Each run is a fresh process (or server) at one max_model_len; runs of the lengths interleave round by round, the
order rotating, so the shared machine's load falls on every length alike. Three levels:
  * ``runner``: the engine's runner in-process (``engine.placement.load``): a prompt, then greedy decode steps,
    each step's wall and process CPU time;
  * ``engine``: ``AsyncEngine`` in-process: a short and a long greedy request; decode = their difference;
  * ``http``: ``ortserve serve`` + ``ortserve bench`` (concurrency 1), the same short and long requests; the
    server's CPU time (its process tree, /proc) over each bench run.
CPU time per token is the figure that a loaded machine leaves meaningful (wall time also counts the waits for a
core); with spinning on, it includes the intra-op threads' spin.

    ORTSERVE_CACHE_DIR=~/.cache/ortserve .venv/bin/python -m perf.ctx_decode --model smollm2-135m-instruct \\
        --lengths 2048,8192 --levels runner,engine,http --rounds 3 --json docs/perf/cpu-context-smollm2.json

Worker mode (``--worker``) is one run; the driver starts it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 128
SHORT_TOKENS = 16  # the short request of the engine/http levels: its cost is the prompt's plus a few steps
# NOTE(perf): prompt-lookup drafts (on by default) accept most of the synthetic prompts' repetitive output, so a
# token would cost a fraction of a step and the difference of two requests would say little; one token a step here.
SPECULATIVE_TOKENS = 0


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += [c for c, parent in parents.items() if parent == p]
    return total


def prompt_ids(num: int) -> list[int]:
    """A fixed prompt of ``num`` ordinary token ids (the same at every length)."""
    return [100 + (i * 37) % 2000 for i in range(num)]


# -- workers (one run each, a fresh process) ---------------------------------------------------------------


def run_runner(model: str, length: int, steps: int, reps: int, batch: int) -> dict[str, Any]:
    import numpy as np

    from engine import placement
    from engine.config import EngineConfig
    from engine.model_loader import read_model_folder

    loaded = placement.load(read_model_folder(model), EngineConfig(max_model_len=length, max_batch=batch))
    runner = loaded.runner
    wall_ms, cpu_ms, prefill_ms, prefill_cpu_ms, verify_ms, verify_cpu_ms = [], [], [], [], [], []
    for rep in range(reps + 1):  # the first is a warm-up
        runner.release(0)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = runner.prefill(0, prompt_ids(PROMPT_TOKENS), 0)
        if rep:
            prefill_ms.append((time.perf_counter() - t0) * 1e3)
            prefill_cpu_ms.append((time.process_time() - c0) * 1e3)
        token, pos = int(np.argmax(logits)), PROMPT_TOKENS
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            logits = runner.decode([0], [token], [pos])
            if rep:
                wall_ms.append((time.perf_counter() - t0) * 1e3)
                cpu_ms.append((time.process_time() - c0) * 1e3)
            token, pos = int(np.argmax(logits[0])), pos + 1
        if runner.can_verify:  # draft checks (speculative decoding's runs): the token and 3 drafted ones
            for _ in range(steps // 2):
                t0, c0 = time.perf_counter(), time.process_time()
                logits = runner.verify(0, [token, 11, 12, 13], pos)
                if rep:
                    verify_ms.append((time.perf_counter() - t0) * 1e3)
                    verify_cpu_ms.append((time.process_time() - c0) * 1e3)
                token, pos = int(np.argmax(logits[0])), pos + 1  # (one accepted: the next check overwrites)
    return {"verify_wall_ms": statistics.median(verify_ms) if verify_ms else None,
            "verify_cpu_ms": statistics.median(verify_cpu_ms) if verify_cpu_ms else None,
            "mask_bytes": getattr(runner, "mask_bytes", None),
            "decode_wall_ms": statistics.median(wall_ms), "decode_wall_min_ms": min(wall_ms),
            "decode_cpu_ms": statistics.median(cpu_ms), "decode_cpu_mean_ms": statistics.fmean(cpu_ms),
            "prefill_wall_ms": statistics.median(prefill_ms), "prefill_cpu_ms": statistics.median(prefill_cpu_ms),
            "steps": len(wall_ms)}


def run_engine(model: str, length: int, steps: int, reps: int, batch: int) -> dict[str, Any]:
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.types import SamplingParams

    engine = AsyncEngine.from_model_dir(model, EngineConfig(max_model_len=length, max_batch=batch,
                                                            speculative_tokens=SPECULATIVE_TOKENS))

    async def one(num: int, tag: str) -> tuple[float, float, list[float]]:
        params = SamplingParams(max_tokens=num, temperature=0.0, ignore_eos=True)
        gaps, last = [], None
        t0, c0 = time.perf_counter(), tree_cpu_s(os.getpid())
        async for _ in engine.generate(prompt_ids(PROMPT_TOKENS), params, tag):
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1e3)
            last = now
        return time.perf_counter() - t0, tree_cpu_s(os.getpid()) - c0, gaps

    async def main() -> dict[str, Any]:
        await one(SHORT_TOKENS, "warm")
        per_token_cpu, per_token_wall, itl = [], [], []
        for rep in range(reps):
            ws, cs, _ = await one(SHORT_TOKENS, f"s{rep}")
            wl, cl, gaps = await one(SHORT_TOKENS + steps, f"l{rep}")
            per_token_cpu.append((cl - cs) / steps * 1e3)
            per_token_wall.append((wl - ws) / steps * 1e3)
            itl += gaps
        return {"decode_cpu_ms": statistics.median(per_token_cpu), "decode_wall_ms": statistics.median(per_token_wall),
                "itl_median_ms": statistics.median(itl), "steps": steps * reps}

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def run_http(model: str, length: int, steps: int, reps: int, batch: int) -> dict[str, Any]:
    from perf.serve import free_port, start_server

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        server = start_server(model, port, None, "--max-model-len", str(length), "--max-batch", str(batch),
                              "--speculative-tokens", str(SPECULATIVE_TOKENS), log=log)
        try:
            def bench(num: int, name: str) -> tuple[float, float, dict[str, Any]]:
                out = Path(tmp) / f"{name}.json"
                cmd = [sys.executable, "-m", "bench", "--url", f"http://127.0.0.1:{port}/v1", "--endpoint",
                       "completions", "--concurrency", "1", "--num-requests", str(reps), "--prompt-tokens",
                       str(PROMPT_TOKENS), "--output-tokens", str(num), "--warmup", "1", "--no-progress",
                       "--out", str(out)]
                c0, t0 = tree_cpu_s(server.pid), time.perf_counter()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                # (the warm-up request is inside both runs alike: the difference is decode only)
                wall, cpu = time.perf_counter() - t0, tree_cpu_s(server.pid) - c0
                return wall, cpu, json.loads(out.read_text())["runs"][0]["summary"]

            bench(SHORT_TOKENS, "warm")  # the server's first requests (arena growth, first runs)
            ws, cs, _ = bench(SHORT_TOKENS, "short")
            wl, cl, summary = bench(SHORT_TOKENS + steps, "long")
            tokens = steps * (reps + 1)  # the warm-up request counts in both runs
            return {"decode_cpu_ms": (cl - cs) / tokens * 1e3, "decode_wall_ms": (wl - ws) / tokens * 1e3,
                    "itl_median_ms": summary["itl"]["p50_ms"], "tpot_median_ms": summary["tpot"]["p50_ms"],
                    "steps": tokens}
        finally:
            server.terminate()
            server.wait(timeout=30)


LEVELS = {"runner": run_runner, "engine": run_engine, "http": run_http}


# -- driver ---------------------------------------------------------------------------------------------------


def run_worker(level: str, model: str, length: int, steps: int, reps: int, batch: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "perf.ctx_decode", "--worker", level, "--model", model, "--lengths", str(length),
           "--steps", str(steps), "--reps", str(reps), "--batch", str(batch)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (level, length): the median over rounds of each figure."""
    out: dict[str, Any] = {}
    for row in rows:
        out.setdefault(row["level"], {}).setdefault(str(row["length"]), []).append(row)
    return {level: {length: {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]
                             if all(isinstance(r.get(k), (int, float)) for r in runs)
                             and k not in ("length", "round")}
                    for length, runs in by_len.items()} for level, by_len in out.items()}


def plot(json_paths: list[str], out: str) -> None:
    """Decode CPU ms/token (bars) and wall ms/token (dots) per (level, max_model_len), one panel per JSON file
    (a model), one bar per set in it (before/after)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(json_paths), figsize=(6.5 * len(json_paths), 4.2), squeeze=False)
    for ax, path in zip(axes[0], json_paths):
        sets = json.loads(Path(path).read_text())
        groups = list(dict.fromkeys((lv, ln) for st in sets for lv, by in st["summary"].items() for ln in by))
        width = 0.8 / len(sets)
        for i, st in enumerate(sets):
            xs = [g + i * width for g, (lv, ln) in enumerate(groups) if ln in st["summary"].get(lv, {})]
            figs = [st["summary"][lv][ln] for lv, ln in groups if ln in st["summary"].get(lv, {})]
            ax.bar(xs, [f["decode_cpu_ms"] for f in figs], width, color=f"C{i}", label=f"{st['label']}: CPU")
            ax.plot(xs, [f["decode_wall_ms"] for f in figs], "o", color=f"C{i}", mec="k", label=f"{st['label']}: wall")
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [f"{lv}\n{ln}" for lv, ln in groups])
        ax.set_title(f"{Path(sets[0]['model']).name}: decode ms per token (medians over rounds)", fontsize=10)
        ax.set_ylabel("ms per token")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model folder or a known name")
    p.add_argument("--lengths", default="2048,8192", help="max_model_len values, comma-separated")
    p.add_argument("--levels", default="runner,engine,http", help="of runner, engine, http")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=48, help="decode steps measured per repetition")
    p.add_argument("--reps", type=int, default=2, help="repetitions per run")
    p.add_argument("--batch", type=int, default=8, help="--max-batch (KV rows)")
    p.add_argument("--label", default="", help="a name for this set of runs (e.g. before/after)")
    p.add_argument("--json", help="append the rows and summary to this JSON file (a list of sets)")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="only plot these JSON files (one panel each) "
                   "into --plot-out")
    p.add_argument("--plot-out", default="cpu-context.png")
    p.add_argument("--worker", choices=sorted(LEVELS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.plot:
        plot(args.plot, args.plot_out)
        return 0
    if args.worker:
        print(json.dumps(LEVELS[args.worker](args.model, lengths[0], args.steps, args.reps, args.batch)))
        return 0
    from engine.builder.pull import resolve_model

    model = str(resolve_model(args.model))
    rows = []
    for rnd in range(args.rounds):
        for level in args.levels.split(","):
            order = lengths[rnd % len(lengths):] + lengths[:rnd % len(lengths)]
            for length in order:
                row = {"level": level, "length": length, "round": rnd,
                       **run_worker(level, model, length, args.steps, args.reps, args.batch)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    if args.json:
        path = Path(args.json)
        sets = json.loads(path.read_text()) if path.exists() else []
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        sets.append({"label": args.label, "model": args.model, "git": git, "lengths": lengths,
                     "steps": args.steps, "reps": args.reps, "batch": args.batch, "prompt_tokens": PROMPT_TOKENS,
                     "summary": summary, "rows": rows})
        path.write_text(json.dumps(sets, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
