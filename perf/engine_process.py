"""`python -m perf.engine_process`: the engine in the server's process vs in its own (--engine-process), on the
CPU, through HTTP: two servers of the same model side by side, `ortserve bench` at 1 and at N streams against each in
short runs ordered A B B A within every round (load that comes and goes on a shared machine hits both alike); a
round's figure per mode is the mean of its two runs, and the ratios are taken within each round.

Each run also records the CPU seconds the server used (its process and the engine process, from /proc) per output
token. Writes a JSON report (--out) and prints the table docs/perf/cpu.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from perf.serve import start_server

ROOT = Path(__file__).resolve().parents[1]
MODES = {"in-process": "--no-engine-process", "engine process": "--engine-process"}


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and its living children (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    pids = [pid] + [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    total = 0
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def _bench(port: int, concurrency: int, num_requests: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "server", "bench", "--url", f"http://127.0.0.1:{port}/v1", "--no-progress",
           "--concurrency", str(concurrency), "--num-requests", str(num_requests), "--prompt-tokens",
           str(args.prompt_tokens), "--output-tokens", str(args.output_tokens), "--warmup", "1", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]["summary"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `serve` flag for both servers")
    p.add_argument("--out", default=None, help="JSON report")
    args = p.parse_args(argv)
    from engine.builder import resolve_model

    model = str(resolve_model(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="engine-process-"))
    servers = {name: (start_server(model, 8730 + i, None, flag, *args.serve_arg, ready_timeout_s=300,
                                   log=tmp / f"{i}.log", cwd=ROOT), 8730 + i)
               for i, (name, flag) in enumerate(MODES.items())}
    runs: list[dict] = []
    try:
        for rnd in range(args.rounds):
            first, second = list(MODES) if rnd % 2 == 0 else list(MODES)[::-1]
            for concurrency, num in ((1, 3), (args.streams, args.streams)):
                for name in (first, second, second, first):
                    proc, port = servers[name]
                    cpu0, load = _tree_cpu_s(proc.pid), os.getloadavg()[0]
                    s = _bench(port, concurrency, num, args, tmp / "run.json")
                    cpu = _tree_cpu_s(proc.pid) - cpu0
                    row = {"round": rnd, "mode": name, "streams": concurrency,
                           "output_tok_s": s["output_tokens_per_s"], "ttft_p50_ms": s["ttft"]["p50_ms"],
                           "itl_p50_ms": s["itl"]["p50_ms"], "tpot_p50_ms": s["tpot"]["p50_ms"],
                           "server_cpu_s": cpu, "cpu_ms_per_token": 1e3 * cpu / s["num_output_tokens"],
                           "load_avg_1m": load, "errors": s["num_errors"]}
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    table = summarize(runs)
    print(table)
    if args.out:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=False)
        Path(args.out).write_text(json.dumps({"git": git.stdout.strip(), "settings": vars(args), "runs": runs},
                                             indent=1))
    return 0


def summarize(runs: list[dict]) -> str:
    """Markdown: per stream count and figure, engine process / in-process within each round, and the median."""
    lines = ["| figure | streams | in-process (median) | engine process (median) | ratio per round | median ratio |",
             "|---|---|---|---|---|---|"]
    for streams in sorted({r["streams"] for r in runs}):
        for key, label in (("output_tok_s", "output tok/s"), ("itl_p50_ms", "ITL p50 ms"),
                           ("ttft_p50_ms", "TTFT p50 ms"), ("cpu_ms_per_token", "server CPU ms / token")):
            by: dict[tuple[int, str], float] = {}
            for r in runs:
                if r["streams"] == streams:  # the mean of a round's two runs of each mode
                    by[r["round"], r["mode"]] = (by[r["round"], r["mode"]] + r[key]) / 2 \
                        if (r["round"], r["mode"]) in by else r[key]
            rounds = sorted({rnd for rnd, _ in by})
            ratios = [by[rnd, "engine process"] / by[rnd, "in-process"] for rnd in rounds]
            med = {m: statistics.median(by[rnd, m] for rnd in rounds) for m in MODES}
            lines.append(f"| {label} | {streams} | {med['in-process']:.1f} | {med['engine process']:.1f} | "
                         f"{', '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}x** |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
