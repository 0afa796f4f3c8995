"""Does loading one model stall another model's running stream? The inter-token latency (ITL) of a running chat
stream on the hub's default model while a second model loads, against the same stream's ITL before the load, in
rounds, through the openai client (issue 37: "while a model loads, the ITL p99 of a running stream on another
model stays <= 2x its idle p99").

    .venv/bin/python -m perf.hub_load_itl --server NAME="EXTRA SERVE FLAGS" [--server ...] --rounds 4 \\
        --out docs/perf/hub-load-itl.json --plot docs/perf/hub-load-itl.png

Each --server is an `ortserve serve` (started here, one at a time, on the CPU) serving --stream-model with
--load-model in its --config, plus the extra flags; servers alternate round by round (ratios within one run only:
the machine is shared). Each round: the load model is unloaded (POST /models/unload), one greedy stream starts
(ignore_eos), --lead-in seconds of its gaps are the idle baseline, then POST /models/load loads the other model;
the gaps that end inside the load's window are the "during" figures; the stream is cut right after.

NOTE: the servers run without speculative decoding (--speculative-tokens 0): with it, a long greedy story's chunk
gaps grow with its length by themselves (prompt-lookup drafts verified at every step: 50 ms at token 100, 250 ms at
token 450 on the 2-core machine), which a comparison of early (idle) and later (during the load) gaps would count
against the load. --control-s measures that drift.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai

from perf.serve import free_port, start_server

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile, linearly interpolated (numpy's default); None for no values."""
    return float(np.percentile(values, 100 * q)) if values else None


async def one_round(base: str, *, stream_model: str, load_model: str, max_tokens: int, lead_in_s: float,
                    control_s: float | None = None) -> dict:
    """One stream on ``stream_model`` with ``load_model`` loaded in its middle: arrival times and the load window
    (``control_s``: no load, a window of that many seconds instead: how the stream's gaps drift by themselves)."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        r = await http.post("/models/unload", json={"model": load_model})
        r.raise_for_status()
        while any(m["id"] == load_model and m["loaded"] for m in (await http.get("/models")).json()["data"]):
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the unloaded process's memory is given back
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
        arrivals: list[float] = []
        first = asyncio.Event()
        stop = asyncio.Event()

        async def stream() -> None:
            s = await client.chat.completions.create(model=stream_model, messages=PROMPT, max_tokens=max_tokens,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    arrivals.append(time.perf_counter())
                    first.set()
                if stop.is_set():
                    break
            await s.close()

        task = asyncio.create_task(stream())
        await first.wait()
        await asyncio.sleep(lead_in_s)
        t0 = time.perf_counter()
        if control_s is None:
            r = await http.post("/models/load", json={"model": load_model})
            r.raise_for_status()
            load_s = r.json()["model"].get("load_time_s")
        else:
            await asyncio.sleep(control_s)
            load_s = None
        t1 = time.perf_counter()
        await asyncio.sleep(0.3)
        stop.set()
        (failed,) = await asyncio.gather(task, return_exceptions=True)
        await client.close()
        if isinstance(failed, BaseException):
            raise RuntimeError(f"the stream failed: {failed!r}") from failed  # noqa: TRY004 - its own failure
    idle, during = [], []
    for a, b in itertools.pairwise(arrivals):
        if b <= t0:
            idle.append(b - a)
        elif b <= t1:  # a gap that ends inside the load's window
            during.append(b - a)
    if arrivals[-1] < t1:
        raise RuntimeError(f"the stream ended before the load did ({len(arrivals)} tokens; the load took "
                           f"{t1 - t0:.1f} s): raise --max-tokens ({max_tokens})")
    return {"load_window_s": t1 - t0, "load_s": load_s, "idle_s": [round(g, 4) for g in idle],
            "during_s": [round(g, 4) for g in during], "arrivals_s": [round(a - t0, 4) for a in arrivals]}


def _ms(values: list[float], q: float) -> str:
    return f"{1e3 * (percentile(values, q) or 0):.0f} ms"


def summarize(rounds: list[dict]) -> dict:
    idle = [g for r in rounds for g in r["idle_s"]]
    during = [g for r in rounds for g in r["during_s"]]
    per_round = [percentile(r["during_s"], 0.99) / percentile(r["idle_s"], 0.99) for r in rounds
                 if r["during_s"] and r["idle_s"]]
    p99_idle, p99_during = percentile(idle, 0.99), percentile(during, 0.99)
    return {
        "itl_p50_ms_idle": 1e3 * (percentile(idle, 0.5) or 0), "itl_p99_ms_idle": 1e3 * (p99_idle or 0),
        "itl_p50_ms_during": 1e3 * (percentile(during, 0.5) or 0), "itl_p99_ms_during": 1e3 * (p99_during or 0),
        "itl_max_ms_idle": 1e3 * max(idle, default=0), "itl_max_ms_during": 1e3 * max(during, default=0),
        "p99_ratio": (p99_during / p99_idle) if p99_idle and p99_during else None,
        "p99_ratio_per_round": per_round,
        "max_ratio_per_round": [max(r["during_s"]) / max(r["idle_s"]) for r in rounds if r["during_s"]],
        "load_window_s_median": statistics.median(r["load_window_s"] for r in rounds),
        "num_gaps_idle": len(idle), "num_gaps_during": len(during), "num_rounds": len(rounds),
    }


def run(args) -> dict:
    servers = [tuple(s.split("=", 1)) if "=" in s else (s, "") for s in args.server]
    tmp = Path(tempfile.mkdtemp(prefix="hub_load_itl_"))
    config = tmp / "models.yaml"
    config.write_text(f"models:\n  - model: {json.dumps(args.load_model)}\n" +
                      (f"    chat_template: {json.dumps(args.load_template)}\n" if args.load_template else ""))
    rounds: list[dict] = []
    for k in range(args.rounds):
        order = servers[k % len(servers):] + servers[:k % len(servers)]
        for name, flags in order:
            port = free_port()
            log = tmp / f"{name}.log"
            proc = start_server(args.stream_model, port, args.threads, "--config", str(config), "--idle-unload-s",
                                "600", "--load-timeout-s", "900", "--max-batch", "2", "--max-model-len", "8192",
                                "--speculative-tokens", "0", *shlex.split(flags), log=log)
            try:
                base = f"http://127.0.0.1:{port}"
                # warm: the stream model answers, the load model has been loaded once (its files in the page cache)
                httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
                    "model": args.stream_model, "messages": PROMPT, "max_tokens": 4}).raise_for_status()
                httpx.post(f"{base}/models/load", json={"model": args.load_model}, timeout=600).raise_for_status()
                kinds = [(name, None)] + ([(f"{name} (no load)", args.control_s)] if args.control_s else [])
                results = []
                for label, control_s in (kinds if k % 2 == 0 else kinds[::-1]):
                    res = asyncio.run(one_round(base, stream_model=args.stream_model, load_model=args.load_model,
                                                max_tokens=args.max_tokens, lead_in_s=args.lead_in,
                                                control_s=control_s))
                    res.update(server=label, round=k)
                    results.append(res)
            finally:
                proc.terminate()
                proc.wait(60)
            for res in results:
                rounds.append(res)
                print(f"[hub_load_itl] round {k + 1}/{args.rounds} {res['server']}: window {res['load_window_s']:.1f} s; "
                      f"ITL p50 idle {_ms(res['idle_s'], 0.5)}, during {_ms(res['during_s'], 0.5)}; p99 idle "
                      f"{_ms(res['idle_s'], 0.99)}, during {_ms(res['during_s'], 0.99)}; max during "
                      f"{_ms(res['during_s'], 1.0)} ({len(res['during_s'])} gaps)", flush=True)
    from bench.report import git_revision, machine_info

    names = list(dict.fromkeys(r["server"] for r in rounds))
    summary = {name: summarize([r for r in rounds if r["server"] == name]) for name in names}
    return {"schema": "ortserve-hub-load-itl/1", "git": git_revision(), "machine": machine_info(),
            "settings": vars(args), "summary": summary, "rounds": rounds}


def plot(report: dict, path: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import save_figure

    names = list(report["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for i, name in enumerate(names):
        for r in (r for r in report["rounds"] if r["server"] == name):
            t = r["arrivals_s"]
            ax.plot(t[1:], [1e3 * (b - a) for a, b in itertools.pairwise(t)], lw=0.7, color=f"C{i}",
                    label=name if r["round"] == min(x["round"] for x in report["rounds"] if x["server"] == name)
                    else None)
            ax.axvspan(0, r["load_window_s"], color=f"C{i}", alpha=0.05)
    ax.set_yscale("log")
    ax.set_xlabel("time from the load request, s (shaded: the load)")
    ax.set_ylabel("inter-token gap of the running stream, ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    for i, name in enumerate(names):
        for key, style in (("during_s", "-"), ("idle_s", ":")):
            gaps = sorted(1e3 * g for r in report["rounds"] if r["server"] == name for g in r[key])
            if gaps:
                ax.plot(gaps, [(j + 1) / len(gaps) for j in range(len(gaps))], style, color=f"C{i}",
                        label=f"{name}, {'during the load' if key == 'during_s' else 'idle'} (p99 ratio "
                              f"{report['summary'][name]['p99_ratio']:.2f})" if key == "during_s" else
                        f"{name}, idle")
    ax.set_xscale("log")
    ax.axhline(0.99, color="grey", lw=0.5)
    ax.set_xlabel("inter-token gap, ms")
    ax.set_ylabel("fraction of gaps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    settings = report["settings"]
    fig.suptitle(f"{settings['stream_model']} stream while {settings['load_model']} loads - "
                 f"{report['machine'].get('cpu_model', '?')}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", default=None,
                   help='NAME="extra serve flags" (repeatable; default: one server, no extra flags)')
    p.add_argument("--stream-model", default="smollm2-135m-instruct")
    p.add_argument("--load-model", default="gemma3-270m")
    p.add_argument("--load-template", default="gemma", help="the load model's --chat-template in the config")
    p.add_argument("--threads", type=int, default=None, help="--intra-op-threads (default: the server's)")
    p.add_argument("--max-tokens", type=int, default=8000)
    p.add_argument("--lead-in", type=float, default=4.0, help="seconds of idle gaps before the load")
    p.add_argument("--control-s", type=float, default=None,
                   help="also measure, on each server, a window of this many seconds with no load (the stream's own "
                        "drift)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--plot")
    args = p.parse_args()
    args.server = args.server or ["default"]
    report = run(args)
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        print(f"plot: {plot(report, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
