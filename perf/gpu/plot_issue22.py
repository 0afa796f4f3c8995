"""Issue 22's GPU serving figures: tokens/s by number of streams and time to first token of a ~900-token prompt, for
the CUDA and WebGPU EPs, before (issue 22's own table, today's engine then) and after, through HTTP.

Reads the ``ortserve bench`` reports that perf/gpu/issue22.sh brings back (cuda_spec0_serving.json and
webgpu_serving.json in a results folder) and writes docs/perf/gpu_issue22.png:
    python -m perf.gpu.plot_issue22 docs/perf/issue22/s6 docs/perf/gpu_issue22.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Issue 22's table (measured on the same H200 with the previous engine): tokens/s and the ~900-token TTFT in ms.
BEFORE = {"CUDA": {"1": 476, "8": 710, "64": 498, "ttft": 2980},
          "WebGPU": {"1": 146, "8": 131, "64": 147, "ttft": 1800}}


def figures(report: dict) -> dict[str, float]:
    def tok_s(name: str) -> float:
        return report[name]["runs"][0]["summary"]["output_tokens_per_s"]

    ttft = report["b8-prompt1000"]["runs"][0]["summary"]["ttft"]["p50_ms"]
    return {"1": tok_s("b1-c1"), "8": tok_s("b8-c8"), "64": tok_s("b64-c64"), "ttft": ttft}


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder, out = Path(argv[0]), Path(argv[1])
    after = {"CUDA": figures(json.loads((folder / "cuda_spec0_serving.json").read_text())),
             "WebGPU": figures(json.loads((folder / "webgpu_serving.json").read_text()))}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, ep in zip(axes[:2], ("CUDA", "WebGPU")):
        streams = ["1", "8", "64"]
        x = range(len(streams))
        ax.bar([i - 0.2 for i in x], [BEFORE[ep][s] for s in streams], 0.4, label="before (issue 22)", color="#bbb")
        bars = ax.bar([i + 0.2 for i in x], [after[ep][s] for s in streams], 0.4, label="after", color="#2b6cb0")
        for b, s in zip(bars, streams):
            ax.annotate(f"{after[ep][s] / after[ep]['1']:.1f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(x), [f"{s} stream{'s' if s != '1' else ''}" for s in streams])
        ax.set_ylabel("output tokens/s (HTTP, all streams)")
        ax.set_title(f"{ep} EP, synthetic 1B INT4 fp16" + (", no drafts" if ep == "CUDA" else ""))
        ax.legend(loc="upper left", fontsize=8)
    ax = axes[2]
    eps = ["CUDA", "WebGPU"]
    ax.bar([i - 0.2 for i in range(2)], [BEFORE[e]["ttft"] for e in eps], 0.4, label="before", color="#bbb")
    ax.bar([i + 0.2 for i in range(2)], [after[e]["ttft"] for e in eps], 0.4, label="after", color="#2b6cb0")
    ax.set_yscale("log")
    ax.set_xticks(range(2), eps)
    ax.set_ylabel("ms (log scale)")
    ax.set_title("TTFT of a ~900-token prompt, idle server")
    for i, e in enumerate(eps):
        ax.annotate(f"{after[e]['ttft']:.0f} ms", (i + 0.2, after[e]["ttft"]), ha="center", va="bottom", fontsize=9)
    ax.legend(fontsize=8)
    fig.suptitle("Issue 22 on one H200: ratios over one stream on --max-batch 1 (labels); logprobs 0 requests")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(json.dumps(after))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
