"""Issue 38's 64-arrival bursts across device calls: TTFT p50 / p99 per burst for each labelled server, as JSON and a
plot (first-token times of every request against its send, one panel per configuration).

    python3 -m perf.gpu.arrivals_plot --out docs/perf/issue38/session10/arrivals.json \\
        --plot docs/perf/gpu_arrivals_session10.png \\
        "N=1 (before)=docs/perf/issue38/session10/call3.json.gz:ours-arrivals" \\
        "N=4=docs/perf/issue38/session10/call6-n4.json.gz:ours-args-arrivals" ...

Each argument is LABEL=FILE:PREFIX, FILE an issue38.json (perf/gpu/issue38.sh's summary, gzipped or not) and PREFIX
the report names' prefix (the bursts are PREFIX1, PREFIX2, ...).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np


def _bursts(path: Path, prefix: str) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        reports = json.load(f)
    out = []
    for name in sorted(n for n in reports if n.startswith(prefix) and n[len(prefix):].isdigit()):
        records = reports[name]["runs"][0].get("records") or []
        ttft = np.array([r["ttft_ms"] for r in records if r.get("ttft_ms") is not None])
        out.append({"report": name, "num": int(ttft.size), "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
                    "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
                    "sends_ms": [round(r["start_ms"], 2) for r in records],
                    "first_tokens_ms": [round(r["start_ms"] + r["ttft_ms"], 2) for r in records
                                        if r.get("ttft_ms") is not None]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("series", nargs="+", help="LABEL=FILE:PREFIX")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    series = {}
    for spec in args.series:
        label, _, rest = spec.rpartition("=")  # labels may hold "=" (N=4), paths do not
        file, _, prefix = rest.rpartition(":")
        series[label] = {"file": file, "prefix": prefix, "bursts": _bursts(Path(file), prefix)}
    summary = {label: {"ttft_p50_ms": [b["ttft_p50_ms"] for b in s["bursts"]],
                       "ttft_p99_ms": [b["ttft_p99_ms"] for b in s["bursts"]]} for label, s in series.items()}
    args.out.write_text(json.dumps({"summary": summary, "series": series}, indent=1))
    for label, s in summary.items():
        print(f"{label:48s} TTFT p50 {s['ttft_p50_ms']} p99 {s['ttft_p99_ms']}")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cols = min(3, len(series))
        rows = -(-len(series) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), sharex=True, sharey=True, squeeze=False)
        for ax, (label, s) in zip(axes.flat, series.items()):
            for i, b in enumerate(s["bursts"]):
                ax.plot(sorted(b["first_tokens_ms"]), np.arange(1, len(b["first_tokens_ms"]) + 1), lw=1.2,
                        label=f"p50 {b['ttft_p50_ms']:.0f} ms" if i < 4 else None)
            ax.axvline(40, color="gray", ls=":", lw=1)
            ax.set_title(label, fontsize=8)
            ax.set_xlabel("first token, ms after the burst's first send", fontsize=7)
            ax.legend(fontsize=6, loc="lower right")
            ax.grid(alpha=0.3)
        for row in axes:
            row[0].set_ylabel("requests with a first token", fontsize=7)
        fig.suptitle("64 requests at once, H200 (CUDA EP), bench GGUF: when each got its first token", fontsize=9)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=130)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
