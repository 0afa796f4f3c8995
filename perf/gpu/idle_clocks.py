"""Is a slow step after idle the GPU's clocks? One served model, the GPU's clocks sampled every 20 ms (nvidia-smi),
and a long prompt sent after idle periods of growing length, each followed at once by a second one (warm). The
engine's step trace says how long each step's session runs took; the samples say the SM clock and power state then.

    python -m perf.gpu.idle_clocks run --model DIR --provider webgpu --out DIR   (on the GPU machine)
    python -m perf.gpu.idle_clocks show DIR                                      (anywhere)

`run` writes DIR/clocks.csv (nvidia-smi), DIR/trace.jsonl (--step-trace), DIR/requests.json (each request's idle
before it, send time and first-token time) and DIR/server.log; `show` prints, for each request, its time to first
token, the prompt steps' session runs, and the SM clock and power state sampled just before it arrived and during
its first step, and writes DIR/idle_clocks.json.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import json
import random
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx

from perf.gpu.gaps import read_trace
from perf.serve import start_server
from bench.scenarios import make_prompt

FIELDS = "timestamp,clocks.sm,clocks.mem,pstate,power.draw,utilization.gpu"
IDLES_S = (0.0, 0.5, 2.0, 5.0, 10.0, 20.0)


def _request(client: httpx.Client, url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True, "temperature": 0}
    sent = time.time()
    first = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and first is None:
                first = time.time()
    return {"sent_s": sent, "first_s": first, "done_s": time.time()}


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    smi = shutil.which("nvidia-smi") or "/usr/local/nvidia/bin/nvidia-smi"
    clocks = None
    if Path(smi).exists():
        clocks = subprocess.Popen([smi, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "20"],
                                  stdout=(out / "clocks.csv").open("w"), stderr=subprocess.STDOUT)
    else:
        (out / "clocks.csv").write_text("")
        print("no nvidia-smi: no clock samples", flush=True)
    rng = random.Random(0)
    records = []
    server = None
    try:
        server = start_server(args.model, args.port, None, "--max-model-len", "1024", "--max-batch", "8",
                              "--speculative-tokens", "0", "--step-trace", str(out / "trace.jsonl"), *args.serve_arg,
                              ready_timeout_s=240, log=out / "server.log", provider=args.provider)
        with httpx.Client(timeout=120) as client:
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            _request(client, url, model, make_prompt(args.prompt_words, rng))  # the first request's one-off costs
            for idle in args.idle_s:
                time.sleep(idle)
                for warm in (False, True):  # NOTE(bench): new words each time, so no prefix is reused
                    record = _request(client, url, model, make_prompt(args.prompt_words, rng))
                    records.append({"idle_s": 0.0 if warm else idle, **record})
                    ttft_ms = (record["first_s"] - record["sent_s"]) * 1e3
                    print(f"idle {records[-1]['idle_s']:5.1f} s: TTFT {ttft_ms:6.1f} ms", flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        if clocks is not None:
            clocks.terminate()
        (out / "requests.json").write_text(json.dumps(records, indent=1))
    show_dir(out)


def read_clocks(path: Path) -> list[dict]:
    """nvidia-smi's samples: wall time (its timestamp, local time), SM and memory MHz, power state, watts, busy %."""
    samples = []
    with path.open() as f:
        for row in csv.reader(f):
            if len(row) != 6:
                continue
            try:
                stamp = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append({"t": stamp, "sm_mhz": float(row[1]), "mem_mhz": float(row[2]),
                                "pstate": row[3].strip(), "watts": float(row[4]), "busy": float(row[5])})
            except ValueError:
                continue
    return samples


def _at(samples: list[dict], t: float) -> dict | None:
    """The last sample taken at or before ``t`` (``samples`` in time order)."""
    i = bisect.bisect_right(samples, t, key=lambda s: s["t"])
    return samples[i - 1] if i else None


def show_dir(out: Path) -> list[dict]:
    samples = read_clocks(out / "clocks.csv")
    steps = [r for r in read_trace(out / "trace.jsonl") if "runs" in r]
    rows = []
    for req in json.loads((out / "requests.json").read_text()):
        mine = [s for s in steps if req["sent_s"] <= s["t"] <= req["first_s"] and s.get("prefill")]
        before, during = _at(samples, req["sent_s"]), _at(samples, mine[0]["t"] + mine[0]["ms"] / 2e3) if mine else None
        rows.append({
            "idle_s": req["idle_s"], "ttft_ms": round((req["first_s"] - req["sent_s"]) * 1e3, 1),
            "prompt_runs_ms": [round(ms, 1) for s in mine for _, ms in s["runs"]],
            "sm_mhz_before": before and before["sm_mhz"], "pstate_before": before and before["pstate"],
            "sm_mhz_during": during and during["sm_mhz"], "pstate_during": during and during["pstate"],
            "watts_during": during and during["watts"],
        })
    for r in rows:
        print(f"idle {r['idle_s']:5.1f} s  TTFT {r['ttft_ms']:6.1f} ms  runs {r['prompt_runs_ms']}  "
              f"SM {r['sm_mhz_before']} -> {r['sm_mhz_during']} MHz  {r['pstate_before']} -> {r['pstate_during']}  "
              f"{r['watts_during']} W")
    if samples:
        mhz = sorted(s["sm_mhz"] for s in samples)
        print(f"{len(samples)} clock samples: SM {mhz[0]:.0f}-{mhz[-1]:.0f} MHz, "
              f"power states {sorted({s['pstate'] for s in samples})}")
    (out / "idle_clocks.json").write_text(json.dumps(rows, indent=1))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--model", required=True)
    p.add_argument("--provider", default="webgpu")
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=8190)
    p.add_argument("--prompt-words", type=int, default=440)
    p.add_argument("--idle-s", type=float, nargs="+", default=IDLES_S, help="the idle spells, in order (seconds)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more server argument (repeatable)")
    s = sub.add_parser("show")
    s.add_argument("dir")
    args = parser.parse_args()
    run(args) if args.cmd == "run" else show_dir(Path(args.dir))


if __name__ == "__main__":
    main()
