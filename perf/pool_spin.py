"""Two sessions in turn on the same cores: what a thread pool left spinning after its run costs the other (issue 48).

A draft model and its target each have an ONNX Runtime session with its own intra-op thread pool. With spinning on
(ortserve's default: lower latency between ops), a pool keeps its threads spinning for a while after a run returns,
and the other model's next run shares the cores with them. This probe times single decode steps of the target and
the draft (perf.ceiling.BareLoop, the engine's session options) alone and in turn, in three settings, each in a fresh
process: ``spin`` (spinning, as before), ``stop`` (spinning within a run, stopped as each run ends:
``EngineConfig.stop_spinning``, ORT's ``session.force_spinning_stop``) and ``nospin`` (no spinning at all).

    ORTSERVE_CACHE_DIR=.cache flock /work/locks/cpu-bench.lock .venv/bin/python -m perf.pool_spin \\
        --json docs/perf/pool-spin-cpu.json

Findings: docs/perf/speculative.md ("Two thread pools").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

MODES = ("spin", "stop", "nospin")


def one_mode(target: Path, draft: Path, mode: str, threads: int, steps: int) -> dict[str, Any]:
    """Median step times (ms) of both models alone and in turn, in one setting."""
    from perf import spec_bound
    from perf.ceiling import BareLoop

    stop = True if mode == "stop" else None
    loops = [BareLoop(m, 1, threads, 1024, stop_spinning=stop, allow_spinning=mode != "nospin")
             for m in (target, draft)]
    prompt = list(range(1000, 1040))
    for loop in loops:
        loop.begin(loop.prefill(prompt), len(prompt))

    def timed(loop: Any) -> float:  # ms
        return 1000 * spec_bound.timed(loop.step)

    t_alone = [timed(loops[0]) for _ in range(steps)]
    d_alone = [timed(loops[1]) for _ in range(steps)]
    t_turn, d_turn = [], []
    for _ in range(steps):
        t_turn.append(timed(loops[0]))
        d_turn.append(timed(loops[1]))
    return {"target_alone_ms": round(statistics.median(t_alone), 1), "target_in_turn_ms": round(statistics.median(t_turn), 1),
            "draft_alone_ms": round(statistics.median(d_alone), 1), "draft_in_turn_ms": round(statistics.median(d_turn), 1)}


def main(argv: list[str] | None = None) -> int:
    from engine.builder.pull import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--mode", choices=MODES, help="one setting in this process (default: each in its own)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    target, draft = resolve_model(args.target), resolve_model(args.draft)
    if args.mode:
        print(json.dumps(one_mode(target, draft, args.mode, args.threads, args.steps)))
        return 0
    report: dict[str, Any] = {"target": str(target), "draft": str(draft), "threads": args.threads, "modes": {}}
    for mode in MODES:
        out = subprocess.run([sys.executable, "-m", "perf.pool_spin", "--target", str(target), "--draft", str(draft),
                              "--threads", str(args.threads), "--steps", str(args.steps), "--mode", mode],
                             capture_output=True, text=True, check=True).stdout
        report["modes"][mode] = json.loads(out.strip().splitlines()[-1])
        print(f"[pool_spin] {mode:7s} {report['modes'][mode]}", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
