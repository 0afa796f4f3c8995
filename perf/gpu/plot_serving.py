"""Plot issue 13's device figures: decode step time per batch bucket (probe_buckets) and what one request sees
over HTTP and engine-direct (serving.sh's reports).

    python -m perf.gpu.plot_serving --serving docs/perf/gpu_serving.json \
        --probe docs/perf/gpu_probe_b64.json --out docs/perf/gpu_serving.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure

from bench.plots import save_figure

RUNS = [("b1-c1", "1 slot, 1 stream"), ("b8-c1", "8 slots, 1 stream"), ("b8-c8", "8 slots, 8 streams"),
        ("b64-c64", "64 slots, 64 streams"), ("b8-prompt1000", "8 slots, ~900-token prompt")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serving", type=Path, required=True)
    ap.add_argument("--probe", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    serving, probe = json.loads(args.serving.read_text()), json.loads(args.probe.read_text())
    fig = Figure(figsize=(13, 4.4), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    steps = {int(b): ms for b, ms in probe["decode_step_ms"].items()}
    buckets = sorted(steps)
    one = steps[1]
    ax1.plot(buckets, [steps[b] for b in buckets], "o-", label="captured step (measured)")
    ax1.plot(buckets, [one * b / 15 for b in buckets], "--", color="gray", label="15x batch 1 per row (the 64-stream target)")
    ax1.plot(buckets, [one * b / 5 for b in buckets], ":", color="gray", label="5x batch 1 per row (the 8-stream target)")
    ax1.set(xscale="log", yscale="log", xlabel="decode rows (bucket)", ylabel="ms per step",
            title="WebGPU decode step per bucket (1B INT4, KV 1,024)")
    ax1.set_xticks(buckets, [str(b) for b in buckets])
    ax1.legend(fontsize=7)
    labels = [label for _, label in RUNS]
    for ax, metric, title in ((ax2, "itl", "inter-token latency p50 (ms)"), (ax3, "ttft", "time to first token p50 (ms)")):
        for j, (prefix, name) in enumerate((("", "HTTP (ortserve bench)"), ("engine-", "engine-direct"))):
            xs, ys = [], []
            for i, (key, _) in enumerate(RUNS):
                report = serving.get(prefix + key)
                value = report and report["runs"][0]["summary"][metric].get("p50_ms")
                if value:
                    xs.append(i + (j - 0.5) * 0.38)
                    ys.append(value)
            bars = ax.bar(xs, ys, 0.38, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(RUNS)), labels, rotation=25, ha="right", fontsize=7)
        ax.set(yscale="log", title=title)
        ax.legend(fontsize=7)
    fig.suptitle("Issue 13 on an H200 through onnxruntime-ep-webgpu 0.4.0: decode at the size of the work; "
                 "prefill stalls between sessions", fontsize=10)
    save_figure(fig, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
