"""The largest gaps between a running stream's tokens in a bench report, each beside what the engine did meanwhile
(a server started with ``--step-trace FILE``, on the same host: both sides carry the wall clock), and the server's
event loop's late wake-ups and garbage collections in both processes.

    python -m perf.gpu.gaps REPORT.json TRACE.jsonl [--top 8] [--out gaps.json]

For each gap: when it began (seconds into the run), how long it was, and every step and garbage collection in it:
the step's length, the core's idle time before it, its decode rows, its prompt chunks and its phases. A gap that no
long step or collection covers happened outside the engine (the server's event loop, the pipe, the client).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from bench.report import load_report

# NOTE(bench): a step that ended this much before a gap began can still be what delayed the gap's next token
_MARGIN_S = 0.005


def read_trace(path: Path) -> list[dict]:
    """Every record of a ``--step-trace`` file (gzipped when it ends in .gz): steps, collections, loop lags."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def token_times(record: dict, started_at: float) -> list[float]:
    """The wall-clock arrival of each content chunk of one report record."""
    if record.get("ttft_ms") is None:
        return []
    t = started_at + (record["start_ms"] + record["ttft_ms"]) / 1e3
    times = [t]
    for gap in record["itl_ms"]:
        t += gap / 1e3
        times.append(t)
    return times


def largest_gaps(report: dict, top: int) -> list[dict]:
    """The ``top`` longest gaps between consecutive chunks of one stream, over every run of the report."""
    gaps = []
    for run in report["runs"]:
        started = run.get("started_at_s")
        if started is None:
            raise ValueError(f"run {run.get('key')}: no started_at_s (a report older than the step trace)")
        for record in run["records"]:
            times = token_times(record, started)
            gaps += [{"run": run["key"], "request": record["index"], "token": i + 1, "start_s": a, "end_s": b,
                      "ms": round((b - a) * 1e3, 3)} for i, (a, b) in enumerate(zip(times, times[1:]))]
    return sorted(gaps, key=lambda g: -g["ms"])[:top]


def beside(gap: dict, trace: list[dict]) -> list[dict]:
    """The trace's records (steps and collections) that overlap the gap, times relative to its start in ms."""
    lo, hi = gap["start_s"] - _MARGIN_S, gap["end_s"]
    out = []
    for record in trace:
        start, end = record["t"], record["t"] + record["ms"] / 1e3
        if end >= lo and start <= hi:
            out.append({**record, "at_ms": round((start - gap["start_s"]) * 1e3, 3)})
    return out


def explain(report: dict, trace: list[dict], top: int) -> list[dict]:
    runs_start = min(r["started_at_s"] for r in report["runs"] if r.get("started_at_s") is not None)
    out = []
    for gap in largest_gaps(report, top):
        inside = beside(gap, trace)
        steps = [r for r in inside if "gc" not in r and not r.get("lag")]
        out.append({**gap, "at_s": round(gap["start_s"] - runs_start, 3),
                    "longest_step_ms": max((r["ms"] for r in steps), default=None),
                    "longest_idle_ms": max((r["idle_ms"] or 0.0 for r in steps), default=None),
                    "gc_ms": round(sum(r["ms"] for r in inside if "gc" in r), 3),
                    "loop_lag_ms": max((r["ms"] for r in inside if r.get("lag")), default=0.0), "trace": inside})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="an `ortserve bench` report (JSON)")
    ap.add_argument("trace", type=Path, help="the server's --step-trace file (or its .gz)")
    ap.add_argument("--top", type=int, default=8, help="how many of the largest gaps (default 8)")
    ap.add_argument("--out", type=Path, help="also write the result as JSON")
    args = ap.parse_args(argv)
    result = explain(load_report(args.report), read_trace(args.trace), args.top)
    for g in result:
        print(f"{g['ms']:8.1f} ms gap at {g['at_s']:.3f} s ({g['run']}, request {g['request']}, token {g['token']}): "
              f"longest step {g['longest_step_ms']} ms, longest idle {g['longest_idle_ms']} ms, gc {g['gc_ms']} ms, "
              f"loop lag {g['loop_lag_ms']} ms")
        for r in g["trace"]:
            if "gc" in r:
                print(f"    {r['at_ms']:+8.1f} ms  gc gen {r['gc']} {r['ms']:.1f} ms ({r.get('proc')}, {r['thread']})")
            elif r.get("lag"):
                print(f"    {r['at_ms']:+8.1f} ms  the {r.get('proc')} event loop woke {r['ms']:.1f} ms late")
            else:
                phases = " ".join(f"{k}={v:.1f}" for k, v in r["phases_ms"].items())
                print(f"    {r['at_ms']:+8.1f} ms  step {r['ms']:.1f} ms (idle before {r['idle_ms']})"
                      f" decode {r['decode']} prefill {r['prefill']} from {r.get('prefill_start')}"
                      f" joined {r['joined']} copies {r['copies']}  {phases}  runs {r.get('runs')}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
