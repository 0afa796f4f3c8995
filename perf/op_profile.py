"""Where a decode step's time goes, per op type: ONNX Runtime's own profiler on a bare loop (perf.ceiling).

The bare loop (the engine's session options, KV buffer and bindings) prefills a prompt, then runs greedy decode
steps with the profiler on; the first steps are left out (warm-up). Per op type: kernel microseconds per step,
nodes per step and the share of all nodes' time; then the costliest nodes and the run's own median.

    .venv/bin/python -m perf.op_profile .cache/smollm2-135m-instruct [--threads 2] [--json out.json]

NOTE(bench): the profiler adds several microseconds to every node (its timestamps and records), so small nodes
look costlier than they are: run with and without a change (perf.graph_ab) to know what a node costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

WARMUP_RUNS = 5  # profiled runs left out: the prefill and the first decode steps


def summarize(events: list[dict[str, Any]], warmup_runs: int = WARMUP_RUNS) -> dict[str, Any]:
    """Per-op-type figures from ONNX Runtime profiler events (its JSON list), runs after ``warmup_runs``.

    Returns:
        ``{"runs", "run_us_median", "nodes_per_run", "node_us_per_run", "ops": {op: {"us", "nodes", "share"}},
        "top_nodes": [[name, us], ...]}``, microseconds per run.
    """
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    if len(runs) <= warmup_runs:
        raise ValueError(f"{len(runs)} profiled runs: need more than the {warmup_runs} left out")
    kept = runs[warmup_runs:]
    start = kept[0]["ts"]
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
             and e["ts"] >= start]
    n = len(kept)
    op_us: dict[str, float] = defaultdict(float)
    op_count: Counter[str] = Counter()
    node_us: dict[str, float] = defaultdict(float)
    for e in nodes:
        op = e["args"]["op_name"]
        op_us[op] += e["dur"]
        op_count[op] += 1
        node_us[e["name"][: -len("_kernel_time")]] += e["dur"]
    total = sum(op_us.values()) or 1.0
    ops = {op: {"us": us / n, "nodes": op_count[op] / n, "share": us / total}
           for op, us in sorted(op_us.items(), key=lambda kv: -kv[1])}
    top = sorted(node_us.items(), key=lambda kv: -kv[1])[:15]
    return {"runs": n, "run_us_median": statistics.median(r["dur"] for r in kept), "nodes_per_run": len(nodes) / n,
            "node_us_per_run": total / n, "ops": ops, "top_nodes": [[name, us / n] for name, us in top]}


def profile_decode(model_dir: Path, threads: int, steps: int, prompt_tokens: int,
                   max_length: int = 2048) -> dict[str, Any]:
    """Profile ``steps`` greedy decode steps after a ``prompt_tokens`` prompt; ``summarize``'s figures."""
    from perf.ceiling import BareLoop

    with tempfile.TemporaryDirectory() as tmp:
        loop = BareLoop(model_dir, 1, threads, max_length, profile_prefix=str(Path(tmp) / "ort"))
        prompt = [(17 * i + 100) % 40000 + 100 for i in range(prompt_tokens)]
        loop.begin(loop.prefill(prompt), prompt_tokens)
        for _ in range(steps + WARMUP_RUNS - 1):
            loop.step()
        path = loop.session.end_profiling()
        events = json.loads(Path(path).read_text())
    return summarize(events)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = profile_decode(args.model_dir, args.threads, args.steps, args.prompt_tokens)
    print(f"{result['runs']} decode runs, median {result['run_us_median'] / 1e3:.2f} ms (profiled); "
          f"{result['nodes_per_run']:.0f} nodes a step, {result['node_us_per_run'] / 1e3:.2f} ms in them")
    for op, f in result["ops"].items():
        print(f"  {op:34s} {f['us']:9.1f} us  {f['nodes']:5.0f} nodes  {100 * f['share']:5.1f}%")
    print("costliest nodes (us a step):")
    for name, us in result["top_nodes"]:
        print(f"  {name:50s} {us:9.1f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
