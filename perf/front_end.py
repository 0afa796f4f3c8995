"""The server process's front-end cost of a burst of arrivals (issue 38, item 4): 64 streamed /v1/completions
requests sent at once to a real `ortserve serve` whose engine runs in a process of its own, as on a GPU.

Reports the server process's CPU (its event-loop thread, and all its threads) per admitted request and per streamed
token event, from /proc/<pid>/task/<tid>/schedstat, plus the bursts' TTFT. Two kinds of burst, interleaved: one
token out (admission, the first event and the end of the stream: the per-request cost) and ``--output-tokens`` out;
their difference over the extra events is the per-token-event cost. ``--profile`` then records py-spy on the
server while more bursts run and prints the loop thread's top frames (self and inclusive).

    PYTHONPATH=. .venv/bin/python -m perf.front_end [--bursts 4] [--profile /tmp/fe.txt] [--json out.json]
    git archive main | tar -x -C /tmp/base   # then, before/after in one run (bursts interleaved):
    PYTHONPATH=. .venv/bin/python -m perf.front_end --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.scenarios import index_words, make_prompt
from perf.serve import free_port, start_server


def _thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds of one thread (/proc schedstat: nanoseconds on a CPU)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def _process_cpu_s(pid: int) -> float:
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += _thread_cpu_s(pid, int(tid))
        except FileNotFoundError:  # a worker thread that ended meanwhile
            pass
    return total


def _loop_sys_s(pid: int) -> float:
    """The loop thread's system (kernel) CPU seconds (/proc stat's stime, in clock ticks): a socket write on
    loopback runs the receiver's side of TCP in the sender's system time too."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> dict[str, float]:
    return {"loop": _thread_cpu_s(pid, pid), "loop_sys": _loop_sys_s(pid), "process": _process_cpu_s(pid)}


async def _one(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> dict:
    """One streamed completion, read as raw SSE lines: TTFT (first text event) and the number of text events."""
    ttft = None
    events = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {") or '"choices":[]' in line:
                continue
            if '"text":""' not in line:
                events += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return {"ttft_s": ttft, "events": events}


async def _burst(client: httpx.AsyncClient, url: str, model: str, n: int, prompt_tokens: int, output_tokens: int,
                 seed: int) -> list[dict]:
    """``n`` requests sent at once (distinct prompts: the request's number in words leads each)."""
    rng = random.Random(seed)
    bodies = [{"model": model, "prompt": make_prompt(prompt_tokens, rng, prefix_words=index_words(seed * n + i)),
               "max_tokens": output_tokens, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": output_tokens}
              for i in range(n)]
    t0 = time.perf_counter()
    return await asyncio.gather(*(_one(client, url, body, t0) for body in bodies))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _top_frames(raw: Path, tid: int, top: int = 25) -> tuple[list[tuple[str, int]], list[tuple[str, int]], int]:
    """(self, inclusive) sample counts of the frames of thread ``tid`` in a py-spy raw (collapsed) file."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    tag = f"thread ({tid})"
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or not frames[0].startswith(tag):
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f
                  for f in frames[1:]]
        if frames:
            own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    return own.most_common(top), inclusive.most_common(top), total


def _report(label: str, rows: dict[int, list[dict]], n: int, output_tokens: int) -> dict:
    """Print one server's medians; returns its figures (CPU ms per request and per token event)."""
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items() if v}
    one, many = med[1], med[output_tokens]
    extra_events = many["events"] - one["events"]
    figures = {
        "loop_ms_per_request": one["loop_cpu_s"] * 1e3 / n,
        "process_ms_per_request": one["process_cpu_s"] * 1e3 / n,
        "loop_ms_per_event": (many["loop_cpu_s"] - one["loop_cpu_s"]) * 1e3 / max(1, extra_events),
        "process_ms_per_event": (many["process_cpu_s"] - one["process_cpu_s"]) * 1e3 / max(1, extra_events),
        "loop_ms_per_burst": many["loop_cpu_s"] * 1e3,
        "process_ms_per_burst": many["process_cpu_s"] * 1e3,
        "ttft_p50_ms": many["ttft_p50_ms"], "ttft_p99_ms": many["ttft_p99_ms"],
    }
    print(f"[{label}]")
    print(f"{'tokens out':>10} {'events':>7} {'loop ms':>8} {'of it sys':>9} {'process ms':>10} {'TTFT p50':>9} "
          f"{'p99':>7}")
    for k, m in med.items():
        print(f"{k:>10} {m['events']:7.0f} {m['loop_cpu_s'] * 1e3:8.1f} {m['loop_sys_s'] * 1e3:9.0f} "
              f"{m['process_cpu_s'] * 1e3:10.1f} "
              f"{m['ttft_p50_ms']:9.1f} {m['ttft_p99_ms']:7.1f}")
    print(f"per request: loop {figures['loop_ms_per_request']:.3f} ms, process "
          f"{figures['process_ms_per_request']:.3f} ms; per token event: loop {figures['loop_ms_per_event']:.4f} "
          f"ms, process {figures['process_ms_per_event']:.4f} ms")
    return {"median": med, "figures": figures}


def _profile(path: str, pid: int, native: bool, run_bursts: Callable[[], None]) -> dict:
    """py-spy record ``pid`` while ``run_bursts()`` runs; prints its loop thread's top frames."""
    mode = ["--native"] if native else ["--nonblocking"]
    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "-r", "400",
                            "-f", "raw", "-o", path, "--threads", *mode],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        run_bursts()
        spy.send_signal(2)
        spy.wait(60)
    finally:
        if spy.poll() is None:
            spy.kill()
    own, inclusive, total = _top_frames(Path(path), pid)
    print(f"\nloop thread: {total} samples\n-- self --")
    for frame, count in own:
        print(f"{100 * count / max(1, total):5.1f}%  {frame}")
    print("-- inclusive --")
    for frame, count in inclusive:
        print(f"{100 * count / max(1, total):5.1f}%  {frame}")
    return {"samples": total, "self": own, "inclusive": inclusive}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=64, help="requests per burst")
    ap.add_argument("--prompt-tokens", type=int, default=25)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--bursts", type=int, default=4, help="measured bursts of each kind (per server)")
    ap.add_argument("--threads", type=int, default=1, help="the engine's intra-op threads")
    ap.add_argument("--baseline", help="a source tree (e.g. `git archive main | tar -x -C DIR`) whose server runs "
                                       "beside this one, bursts interleaved: the before/after of one run")
    ap.add_argument("--profile", help="py-spy record this tree's server for extra bursts; raw samples go here")
    ap.add_argument("--profile-tokens", type=int, help="tokens out in the profiled bursts (default --output-tokens)")
    ap.add_argument("--profile-native", action="store_true", help="py-spy --native (blocking sampling): C frames too")
    ap.add_argument("--skip-measure", action="store_true", help="only the profile")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--server-arg", action="append", default=[], help="one more `ortserve serve` argument")
    args = ap.parse_args(argv)

    n = args.requests
    here = str(Path(__file__).resolve().parents[1])
    trees = {"this": here, **({"baseline": str(Path(args.baseline).resolve())} if args.baseline else {})}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for label, tree in trees.items():
            port = free_port()
            env = {**os.environ, "PYTHONPATH": tree}
            proc = start_server(args.model, port, args.threads, "--engine-process", "--max-batch", str(n),
                                "--max-queue", str(n), "--max-model-len", "512", *args.server_arg,
                                ready_timeout_s=300, cwd=Path(tree), env=env)
            servers[label] = (proc, f"http://127.0.0.1:{port}")
        loop = asyncio.new_event_loop()
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=4 * n, max_keepalive_connections=4 * n),
                                   timeout=300)
        models = {label: httpx.get(f"{url}/v1/models").json()["data"][0]["id"] for label, (_, url) in servers.items()}

        def burst(label: str, out_tokens: int, seed: int) -> list[dict]:
            url = servers[label][1]
            return loop.run_until_complete(_burst(client, url, models[label], n, args.prompt_tokens, out_tokens, seed))

        for label in servers:  # warm-up: connections, the prompt shapes, lazy imports
            burst(label, args.output_tokens, 1)
            burst(label, 1, 2)
        rows = {label: {1: [], args.output_tokens: []} for label in servers}
        kinds = [(label, k) for label in servers for k in (1, args.output_tokens)]
        for i in range(0 if args.skip_measure else args.bursts):
            shift = i % len(kinds)
            for label, out_tokens in kinds[shift:] + kinds[:shift]:  # a different order each round
                pid = servers[label][0].pid
                time.sleep(0.3)
                c0 = _cpu(pid)
                results = burst(label, out_tokens, 10 + 2 * i + (out_tokens > 1))
                c1 = _cpu(pid)
                events = sum(r["events"] for r in results)
                ttfts = [r["ttft_s"] * 1e3 for r in results if r["ttft_s"] is not None]
                rows[label][out_tokens].append({"loop_cpu_s": c1["loop"] - c0["loop"],
                                                "loop_sys_s": c1["loop_sys"] - c0["loop_sys"],
                                                "process_cpu_s": c1["process"] - c0["process"], "events": events,
                                                "ttft_p50_ms": _pct(ttfts, 0.5), "ttft_p99_ms": _pct(ttfts, 0.99)})
        out: dict = {"args": vars(args), "rows": rows, "servers": {}}
        if not args.skip_measure:
            print(f"{n} requests at once, {args.prompt_tokens}-token prompts; medians of {args.bursts} bursts each "
                  f"(server CPU: loop = its event-loop thread, process = all its threads; engine in its own process)")
            for label in servers:
                out["servers"][label] = _report(label, rows[label], n, args.output_tokens)
            if "baseline" in servers:
                this, base = out["servers"]["this"]["figures"], out["servers"]["baseline"]["figures"]
                ratios = {k: base[k] / this[k] for k in this if this[k] and k.endswith(("request", "event", "burst"))}
                out["baseline_over_this"] = ratios
                print("baseline / this: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        if args.profile:
            out["profile"] = _profile(args.profile, servers["this"][0].pid, args.profile_native, lambda: [
                (burst("this", args.profile_tokens or args.output_tokens, 100 + i), time.sleep(0.2))
                for i in range(args.bursts)])
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        loop.run_until_complete(client.aclose())
        loop.close()
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
