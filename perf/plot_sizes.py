"""Issue 45's sizes plot: decode tokens/s (1 and 2 streams) and TTFT of a 2,000-token prompt against model size, for
ortserve and llama.cpp's llama-server, from `ortserve bench --scenario sizes` reports (the CPU) and issue45.sh's
summary (the GPU; rows it has not measured yet are drawn as pending).

    python -m perf.plot_sizes docs/perf/sizes-cpu-*.json [--gpu issue45.json] --out docs/perf/sizes.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def points(reports: list[dict]) -> list[dict]:
    """One point per report: its size in parameters and each server's medians."""
    out = []
    for r in reports:
        params = r.get("model_params")
        if params is None:  # (a report from before the field)
            from bench.sizes import model_params

            params = model_params(Path(r["settings"]["gguf"]))
        s = r["summary"]
        out.append({"params_b": params / 1e9, "name": Path(r["settings"]["gguf"]).stem,
                    **{f"{k}:{n}": (s.get(k) or {}).get(n) for k in ("decode_tok_s_1", "decode_tok_s_2", "ttft_s")
                       for n in ("ortserve", "llama-server")}})
    return sorted(out, key=lambda p: p["params_b"])


# issue45.sh's report names -> the model's parameters (billions)
GPU_SIZES = {"coder": 1.54, "llama-3.1-8b": 8.03, "qwen2.5-32b": 32.76}


def gpu_points(summary: dict) -> list[dict]:
    """issue45.sh's summary (report name -> runs) as points: ours without drafts and llama-server, 1 and 64 streams
    (output tokens/s) and the idle 2,000-token TTFT (p50, seconds)."""
    out = []
    for size, params in GPU_SIZES.items():
        point = {"params_b": params, "name": size}
        for who, prefix in (("ortserve", f"{size}-ours-spec0"), ("llama-server", f"{size}-peer")):
            for key, run, field in (("tok_s_1", "c1", "output_tokens_per_s"), ("tok_s_64", "c64", "output_tokens_per_s"),
                                    ("ttft_s", "ttft-idle", None)):
                runs = (summary.get(f"{prefix}-{run}") or {}).get("runs") or [{}]
                s = runs[0].get("summary", {})
                value = s.get(field) if field else ((s.get("ttft") or {}).get("p50_ms") or 0) / 1e3 or None
                point[f"{key}:{who}"] = value
        if any(v is not None for k, v in point.items() if ":" in k):
            out.append(point)
    return out


def plot(cpu: list[dict], gpu: list[dict], path: Path, gpu_label: str = "GPU") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    rows = ((cpu, "CPU, 2 cores", (("decode_tok_s_1", "decode tok/s, 1 stream"),
                                   ("decode_tok_s_2", "decode tok/s, 2 streams"), ("ttft_s", "TTFT s, 2,000 tokens"))),
            (gpu, gpu_label, (("tok_s_1", "tok/s, 1 stream (drafts off)"), ("tok_s_64", "tok/s, 64 streams"),
                           ("ttft_s", "TTFT s, 2,000 tokens, idle"))))
    for row_axes, (pts, device, panels) in zip(axes, rows):
        for ax, (key, title) in zip(row_axes, panels):
            for name, style in (("ortserve", "o-"), ("llama-server", "s--")):
                xy = [(p["params_b"], p[f"{key}:{name}"]) for p in pts if p.get(f"{key}:{name}") is not None]
                if xy:
                    ax.plot(*zip(*xy), style, label=name)
            if not pts:
                ax.text(0.5, 0.5, "pending: perf/gpu/issue45.sh\n(docs/perf/sizes.md)", ha="center", va="center",
                        transform=ax.transAxes, style="italic", color="gray")
            ax.set_xscale("log")
            ax.set_xlabel("model parameters (billions)")
            ax.set_title(f"{device}: {title}", fontsize=10)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.suptitle("ortserve and llama.cpp's llama-server on the same GGUFs (issue 45)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="sizes reports (ortserve bench --scenario sizes --out)")
    p.add_argument("--gpu", type=Path, help="issue45.sh's issue45.json (absent: the GPU rows are pending)")
    p.add_argument("--gpu-label", default="GPU", help="the GPU row's title (the card the figures came from)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    cpu = points([json.loads(r.read_text()) for r in args.reports])
    summary = json.loads(args.gpu.read_text()) if args.gpu and args.gpu.exists() else {}
    gpu = gpu_points(summary.get("reports", summary))  # docs/perf/sizes-h100.json keeps them under "reports"
    print(plot(cpu, gpu, args.out, args.gpu_label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
