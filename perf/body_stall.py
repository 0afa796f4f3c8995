"""Do huge request bodies stall other streams? A stream runs on a real `ortserve serve`; meanwhile a client
posts a 4.2 MB chat body of 135,000 small messages (issue 25's probe: 140,000 in 4 MB). The figure is the
longest gap between the stream's chunks while that body is read, validated and answered, beside the longest gap of the same
stream with no such body (the baseline), in rounds; and the server's RSS after rounds of two concurrent
4 MB prompts beside a stream.

Several servers can be compared in one run (each ``--target label=ROOT``: a checkout whose ``.venv`` runs
``python -m server serve``); the idle ones are paused (SIGSTOP) while one is measured, rounds interleaved.

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m perf.body_stall --target after=. --target before=/work/main \\
        --model .cache/smollm2-135m-instruct --rounds 3 --json docs/perf/body_stall.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from perf.serve import free_port


def start(root: Path, model: str, port: int) -> subprocess.Popen:
    python = root / ".venv" / "bin" / "python"
    cmd = [str(python), "-m", "server", "serve", "--model", model, "--provider", "cpu", "--intra-op-threads", "2",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--served-model-name", "m"]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server in {root} exited with {proc.returncode}")
        time.sleep(0.5)
    raise RuntimeError(f"server in {root} not ready")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def stream_gaps(base: str, side: Any = None, max_tokens: int = 300) -> dict[str, Any]:
    """Stream ``max_tokens`` tokens; after 10 chunks run ``side()`` in a thread. Returns the longest gap between
    chunks while ``side`` ran (plus 0.3 s after it), and over the whole stream."""
    arrivals: list[float] = []
    window: list[float] = []
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    worker = None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 10 and side is not None:
                window.append(time.monotonic())

                def run() -> None:
                    side()
                    window.append(time.monotonic())

                worker = threading.Thread(target=run)
                worker.start()
    if worker is not None:
        worker.join()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    out = {"chunks": len(arrivals), "max_gap_s": max(gaps) if gaps else None}
    if len(window) == 2:
        lo, hi = window[0], window[1] + 0.3
        inside = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= lo and a <= hi]
        out["max_gap_during_s"] = max(inside) if inside else None
        out["side_s"] = window[1] - window[0]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", required=True, metavar="LABEL=ROOT")
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rss-rounds", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    # NOTE(bench): compact JSON, so 135,000 messages stay under the default 4 MiB body limit (4.19 MB)
    many = json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}] * 135_000},
                      separators=(",", ":")).encode()
    big_prompt = json.dumps({"model": "m", "max_tokens": 1,
                             "messages": [{"role": "user", "content": "word " * 800_000}]}).encode()
    targets = {}
    for spec in args.target:
        label, _, root = spec.partition("=")
        port = free_port()
        targets[label] = (port, start(Path(root).resolve(), str(Path(args.model).resolve()), port))
    results: dict[str, Any] = {label: {"stall": [], "rss_mib": []} for label in targets}
    try:
        def pause_others(label: str) -> None:
            for other, (_, proc) in targets.items():
                os.kill(proc.pid, signal.SIGCONT if other == label else signal.SIGSTOP)

        for rnd in range(args.rounds):
            for label in (list(targets) if rnd % 2 == 0 else list(targets)[::-1]):
                pause_others(label)
                base = f"http://127.0.0.1:{targets[label][0]}"
                status: list[int] = []
                post = lambda: status.append(httpx.post(f"{base}/v1/chat/completions", content=many,  # noqa: E731
                                                        headers={"content-type": "application/json"},
                                                        timeout=600).status_code)
                baseline = stream_gaps(base)
                loaded = stream_gaps(base, post)
                row = {"round": rnd, "baseline_max_gap_s": baseline["max_gap_s"],
                       "max_gap_during_s": loaded.get("max_gap_during_s"), "body_s": loaded.get("side_s"),
                       "status": status, "load": os.getloadavg()}
                results[label]["stall"].append(row)
                print(f"[body_stall] {label} round {rnd}: {row}", file=sys.stderr)
        for label, (port, proc) in targets.items():
            pause_others(label)
            base = f"http://127.0.0.1:{port}"
            for rnd in range(args.rss_rounds):
                def two() -> None:
                    threads = [threading.Thread(target=lambda: httpx.post(
                        f"{base}/v1/chat/completions", content=big_prompt,
                        headers={"content-type": "application/json"}, timeout=600)) for _ in range(2)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()

                stream_gaps(base, two, max_tokens=100)
                results[label]["rss_mib"].append(rss_mib(proc.pid))
                print(f"[body_stall] {label} rss round {rnd}: {results[label]['rss_mib'][-1]:.0f} MiB", file=sys.stderr)
    finally:
        for _, proc in targets.values():
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            proc.wait(30)
    summary = {label: {"max_gap_during_s_median": statistics.median(r["max_gap_during_s"] for r in v["stall"]),
                       "baseline_max_gap_s_median": statistics.median(r["baseline_max_gap_s"] for r in v["stall"]),
                       "rss_first_mib": v["rss_mib"][0] if v["rss_mib"] else None,
                       "rss_last_mib": v["rss_mib"][-1] if v["rss_mib"] else None}
               for label, v in results.items()}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
