"""Interleaved CPU comparison (issues 3 and 6): the same requests alternate between ortserve (HTTP and
engine-direct), onnxruntime-genai and llama.cpp, so load that comes and goes hits every target alike.

Driven by perf/compare_cpu.sh, which starts the two servers. Imports the engine and onnxruntime_genai
lazily; writes compare.json (every record), summary.json/summary.md (per-round ratios and their medians)
and cpu.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

from bench.loadgen import HttpBackend, HttpSettings, run_load
from bench.metrics import RequestRecord, summarize
from bench.scenarios import iter_requests

SINGLE = ("ortserve", "engine", "genai", "llama.cpp")  # single-stream targets, rotated per request
PREFILL = ("ortserve", "genai", "llama.cpp")
BATCH = ("ortserve", "llama.cpp")  # the concurrency runs
EOS_ID = 2  # SmolLM2's eos; llama-cpp-python ignores ignore_eos/min_tokens, a logit bias holds it off


class GenaiBackend:
    """onnxruntime-genai (perf.genai_driver.GenaiRunner) behind the bench's ``send`` interface."""

    def __init__(self, model_dir: str, threads: int) -> None:
        from perf.genai_driver import GenaiRunner

        self.runner = GenaiRunner(model_dir, threads=threads)
        self.model = "onnxruntime-genai"

    async def prepare(self) -> None:
        return None

    async def send(self, spec, record: RequestRecord) -> None:
        # NOTE(bench): run on the loop's thread on purpose: nothing else runs meanwhile, as in its own driver.
        self.runner.generate(spec.prompt, spec.max_tokens, record)

    async def aclose(self) -> None:
        return None


async def _one(backend, spec) -> RequestRecord:
    record = RequestRecord(index=spec.index, start_s=0.0, num_prompt_tokens_target=spec.num_prompt_tokens_target,
                           max_tokens=spec.max_tokens)
    await backend.send(spec, record)
    return record


async def _interleaved(backends: dict, names: tuple[str, ...], specs: list, rnd: int, pause_s: float) -> dict:
    """Each spec goes to every target in turn; the order rotates per spec. Returns {name: [records]}."""
    out: dict[str, list[RequestRecord]] = {n: [] for n in names}
    for i, spec in enumerate(specs):
        k = (i + rnd) % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(await _one(backends[name], spec))
            await asyncio.sleep(pause_s)  # let the previous target's spinning threads go idle
    return out


def _summ(records: list[RequestRecord]) -> dict:
    duration = sum(r.e2e_s or 0.0 for r in records) or 1e-9  # back to back: the sum of request times
    return summarize(records, duration)


async def run(args: argparse.Namespace) -> dict:
    from bench.engine_driver import EngineBackend
    from engine.config import EngineConfig

    eos_bias = {"logit_bias": {str(EOS_ID): -100}}
    backends = {
        "ortserve": HttpBackend(HttpSettings(url=args.ours)),
        "llama.cpp": HttpBackend(HttpSettings(url=args.llama, extra_body=eos_bias)),
        "engine": EngineBackend(args.model_dir, engine_config=EngineConfig(
            provider="cpu", max_batch=8, intra_op_threads=args.threads)),
        "genai": GenaiBackend(args.model_dir, args.threads),
    }
    for b in backends.values():
        await b.prepare()
    report: dict = {"settings": vars(args), "rounds": []}
    try:
        warm = list(iter_requests("fixed", 1, args.prompt_tokens, 16, seed=10**6))
        for name in SINGLE:
            await _one(backends[name], warm[0])
        for rnd in range(args.rounds):
            entry: dict = {"round": rnd + 1, "load_before": _loadavg()}
            print(f"[compare] round {rnd + 1}/{args.rounds}: single stream", file=sys.stderr, flush=True)
            specs = list(iter_requests("fixed", args.single_requests, args.prompt_tokens, args.output_tokens,
                                       seed=rnd))
            single = await _interleaved(backends, SINGLE, specs, rnd, args.pause)
            print(f"[compare] round {rnd + 1}/{args.rounds}: prompt processing", file=sys.stderr, flush=True)
            specs = list(iter_requests("fixed", args.prefill_requests, args.prefill_tokens, 1, seed=100 + rnd))
            prefill = await _interleaved(backends, PREFILL, specs, rnd, args.pause)
            batch = {}
            for j in range(len(BATCH)):
                name = BATCH[(j + rnd) % len(BATCH)]
                print(f"[compare] round {rnd + 1}/{args.rounds}: {name} at concurrency {args.concurrency}",
                      file=sys.stderr, flush=True)
                specs = iter_requests("fixed", args.batch_requests, args.prompt_tokens, args.output_tokens,
                                      seed=200 + rnd)
                result = await run_load(backends[name], specs, args.batch_requests, concurrency=args.concurrency,
                                        duration_s=args.duration, progress=False)
                batch[name] = {"summary": summarize(result.records, result.duration_s),
                               "records": [r.to_json() for r in result.records]}
                await asyncio.sleep(args.pause)
            entry["load_after"] = _loadavg()
            entry["single"] = {n: {"summary": _summ(rs), "records": [r.to_json() for r in rs]}
                               for n, rs in single.items()}
            entry["prefill"] = {n: {"summary": _summ(rs), "records": [r.to_json() for r in rs]}
                                for n, rs in prefill.items()}
            entry["batch"] = batch
            report["rounds"].append(entry)
            print(f"[compare] round {rnd + 1} done, load {entry['load_before']} -> {entry['load_after']}",
                  file=sys.stderr, flush=True)
    finally:
        for b in backends.values():
            await b.aclose()
    return report


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# --- summary ---------------------------------------------------------------------------------------------

def _get(d: dict | None, *keys: str) -> float | None:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return float(d) if isinstance(d, (int, float)) else None


def figures_of(entry: dict) -> dict[str, float | None]:
    """The figures of one round (tok/s and ms)."""
    s, p, b = entry["single"], entry["prefill"], entry["batch"]
    tokens = _get(p, "ortserve", "summary", "mean_prompt_tokens") or _get(p, "genai", "summary", "mean_prompt_tokens")

    def prompt_rate(name: str) -> float | None:
        # NOTE(bench): prompt tokens / p50 TTFT; the prompts are the same for every target and their length is
        # the usage ortserve/onnxruntime-genai report (llama-cpp-python's stream has no usage).
        ttft = _get(p, name, "summary", "ttft", "p50_ms")
        return tokens / (ttft / 1e3) if tokens and ttft else None

    return {
        "decode_ours": _get(s, "ortserve", "summary", "decode_tokens_per_s_per_stream"),
        "decode_engine": _get(s, "engine", "summary", "decode_tokens_per_s_per_stream"),
        "decode_genai": _get(s, "genai", "summary", "decode_tokens_per_s_per_stream"),
        "decode_llama": _get(s, "llama.cpp", "summary", "decode_tokens_per_s_per_stream"),
        "out1_ours": _get(s, "ortserve", "summary", "output_tokens_per_s"),
        "out1_engine": _get(s, "engine", "summary", "output_tokens_per_s"),
        "out1_genai": _get(s, "genai", "summary", "output_tokens_per_s"),
        "out1_llama": _get(s, "llama.cpp", "summary", "output_tokens_per_s"),
        "outN_ours": _get(b, "ortserve", "summary", "output_tokens_per_s"),
        "outN_llama": _get(b, "llama.cpp", "summary", "output_tokens_per_s"),
        "ttftN_p99_ours": _get(b, "ortserve", "summary", "ttft", "p99_ms"),
        "ttftN_p50_ours": _get(b, "ortserve", "summary", "ttft", "p50_ms"),
        "ttftN_p50_llama": _get(b, "llama.cpp", "summary", "ttft", "p50_ms"),
        "prefill_ours": prompt_rate("ortserve"),
        "prefill_genai": prompt_rate("genai"),
        "prefill_llama": prompt_rate("llama.cpp"),
    }


LABELS = {
    "decode_ours": "decode tok/s per stream, 1 stream: ortserve (HTTP)",
    "decode_engine": "decode tok/s per stream, 1 stream: ortserve engine-direct",
    "decode_genai": "decode tok/s per stream, 1 stream: onnxruntime-genai",
    "decode_llama": "decode tok/s per stream, 1 stream: llama.cpp (llama-cpp-python server)",
    "out1_ours": "output tok/s incl. TTFT, 1 stream: ortserve (HTTP)",
    "out1_engine": "output tok/s incl. TTFT, 1 stream: ortserve engine-direct",
    "out1_genai": "output tok/s incl. TTFT, 1 stream: onnxruntime-genai",
    "out1_llama": "output tok/s incl. TTFT, 1 stream: llama.cpp",
    "outN_ours": "aggregate output tok/s, N streams: ortserve (HTTP)",
    "outN_llama": "aggregate output tok/s, N streams: llama-cpp-python server",
    "ttftN_p50_ours": "TTFT p50 ms, N streams: ortserve",
    "ttftN_p99_ours": "TTFT p99 ms, N streams: ortserve",
    "ttftN_p50_llama": "TTFT p50 ms, N streams: llama-cpp-python server",
    "prefill_ours": "prompt tok/s (prefill-token prompt, p50 TTFT): ortserve (HTTP)",
    "prefill_genai": "prompt tok/s (prefill-token prompt, p50 TTFT): onnxruntime-genai",
    "prefill_llama": "prompt tok/s (prefill-token prompt, p50 TTFT): llama.cpp",
}
# (name, numerator, denominator, target): every ratio is taken within one round, then the median over rounds.
RATIOS: list[tuple[str, str, str, float | None]] = [
    ("decode, 1 stream: ortserve (HTTP) / onnxruntime-genai", "decode_ours", "decode_genai", 1.0),
    ("decode, 1 stream: ortserve engine-direct / onnxruntime-genai", "decode_engine", "decode_genai", 1.0),
    ("decode, 1 stream: ortserve (HTTP) / llama.cpp", "decode_ours", "decode_llama", 1.3),
    ("decode, 1 stream: ortserve engine-direct / llama.cpp", "decode_engine", "decode_llama", 1.3),
    ("prompt processing: ortserve (HTTP) / llama.cpp", "prefill_ours", "prefill_llama", 2.0),
    ("prompt processing: ortserve (HTTP) / onnxruntime-genai", "prefill_ours", "prefill_genai", None),
    ("N streams aggregate / ortserve 1 stream (output tok/s)", "outN_ours", "out1_ours", 4.0),
    ("N streams aggregate: ortserve / llama-cpp-python server", "outN_ours", "outN_llama", 6.0),
    ("N streams: llama.cpp p50 TTFT / ortserve p99 TTFT (> 1: ours lower)", "ttftN_p50_llama", "ttftN_p99_ours", 1.0),
    ("HTTP streaming / engine-direct, 1 stream (output tok/s)", "out1_ours", "out1_engine", 0.95),
]


def summarize_report(report: dict) -> dict:
    per_round = [figures_of(e) for e in report["rounds"]]

    def med(xs: list[float | None]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    figures = {k: {"per_round": [f[k] for f in per_round], "median": med([f[k] for f in per_round])}
               for k in LABELS}
    ratios = []
    for name, a, b, target in RATIOS:
        per = [(f[a] / f[b]) if (f[a] is not None and f[b]) else None for f in per_round]
        m = med(per)
        ratios.append({"name": name, "per_round": per, "median": m, "target": target,
                       "met": None if (m is None or target is None) else m >= target})
    loads = [f"{e['load_before']} -> {e['load_after']}" for e in report["rounds"]]
    return {"figures": figures, "ratios": ratios, "loadavg_per_round": loads}


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(summary: dict, n: int) -> str:
    lines = ["| ratio (each measured within one round; median of the rounds) | target | median | per round | met |",
             "|---|---|---|---|---|"]
    for r in summary["ratios"]:
        target = "" if r["target"] is None else f">= {r['target']:.2f}x"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {r['name'].replace('N streams', f'{n} streams')} | {target} | **{_fmt(r['median'], 2)}x** | "
                     f"{', '.join(_fmt(x, 2) for x in r['per_round'])} | {met} |")
    lines += ["", "| figure | median | per round |", "|---|---|---|"]
    for k, v in summary["figures"].items():
        lines.append(f"| {LABELS[k].replace('N streams', f'{n} streams')} | {_fmt(v['median'])} | "
                     f"{', '.join(_fmt(x) for x in v['per_round'])} |")
    lines += ["", "Load average (1/5/15 min) before -> after each round: " + "; ".join(summary["loadavg_per_round"])]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path, title: str, n: int, prompt: int) -> Path:
    from matplotlib.figure import Figure

    f = {k: (v["median"] or 0.0) for k, v in summary["figures"].items()}
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    axes = fig.subplots(1, 3)
    panels: list[tuple[str, list[tuple[str, str, str]]]] = [
        ("decode tok/s, 1 stream", [("ortserve\nHTTP", "decode_ours", "C0"), ("ortserve\nengine", "decode_engine", "C0"),
                                    ("onnxruntime\n-genai", "decode_genai", "C2"), ("llama.cpp", "decode_llama", "C3")]),
        (f"prompt tok/s ({prompt}-token prompt)", [("ortserve", "prefill_ours", "C0"),
                                                   ("onnxruntime\n-genai", "prefill_genai", "C2"),
                                                   ("llama.cpp", "prefill_llama", "C3")]),
        ("output tok/s, all streams", [("ortserve\n1 stream", "out1_ours", "C0"),
                                       (f"ortserve\n{n} streams", "outN_ours", "C0"),
                                       ("llama.cpp\n1 stream", "out1_llama", "C3"),
                                       (f"llama.cpp\n{n} streams", "outN_llama", "C3")]),
    ]
    for ax, (name, bars) in zip(axes, panels):
        ax.bar([b[0] for b in bars], [f[b[1]] for b in bars], color=[b[2] for b in bars])
        for i, b in enumerate(bars):
            ax.annotate(f"{f[b[1]]:.0f}", (i, f[b[1]]), ha="center", va="bottom", fontsize=9)
        ax.set_title(name)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.compare_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--ours", required=True, help="ortserve's OpenAI base URL")
    p.add_argument("--llama", required=True, help="llama-cpp-python server's OpenAI base URL")
    p.add_argument("--model-dir", required=True, help="the model folder (engine-direct and onnxruntime-genai)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--single-requests", type=int, default=4, help="requests per target per round, 1 stream")
    p.add_argument("--prefill-requests", type=int, default=3, help="prompt-processing requests per target per round")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--batch-requests", type=int, default=16, help="requests per concurrency run")
    p.add_argument("--duration", type=float, default=600.0, help="cap per concurrency run, s")
    p.add_argument("--pause", type=float, default=0.3, help="idle seconds between requests of different targets")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--summarize", action="store_true", help="only redo the summary from OUT/compare.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        report = json.loads((out / "compare.json").read_text())
    else:
        report = asyncio.run(run(args))
        from bench.report import git_revision, machine_info

        report.update(git=git_revision(), machine=machine_info())
        (out / "compare.json").write_text(json.dumps(report))
    summary = summarize_report(report)
    n = int(report["settings"]["concurrency"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary, n)
    (out / "summary.md").write_text(text)
    rounds = len(report["rounds"])
    plot(summary, out / "cpu.png", f"SmolLM2-135M-Instruct Q4_1 on a 2-core CPU, greedy; medians of {rounds} "
         f"interleaved rounds", n, int(report["settings"]["prefill_tokens"]))
    print(text)
    print(f"summary: {out / 'summary.md'}; plot: {out / 'cpu.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
