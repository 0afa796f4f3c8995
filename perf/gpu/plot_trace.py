"""Engine steps over a bench run from ``--step-trace`` files: each step's length against the time since the engine
last woke from an idle spell, steps with a prompt chunk apart from decode-only ones, one panel per trace.

    python -m perf.gpu.plot_trace OUT.png "TITLE=TRACE.jsonl[.gz]" ...
"""

from __future__ import annotations

import sys
from pathlib import Path

from perf.gpu.gaps import read_trace

IDLE_MS = 300.0  # an idle spell: the core waited this long for work before the step


def read_steps(path: Path) -> list[dict]:
    return [r for r in read_trace(path) if "gc" not in r and not r.get("lag")]


def since_idle(steps: list[dict]) -> list[float]:
    """Seconds from the first step after the last idle spell to each step."""
    out, woke = [], steps[0]["t"] if steps else 0.0
    for r in steps:
        if r["idle_ms"] is not None and r["idle_ms"] >= IDLE_MS:
            woke = r["t"]
        out.append(r["t"] - woke)
    return out


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, panels = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, (title, trace) in zip(axes[0], panels):
        steps = read_steps(Path(trace))
        x = since_idle(steps)
        for kind, color, pick in (("decode only", "#2b6cb0", lambda r: not r["prefill"] and not r["joined"]),
                                  ("with prompt tokens", "#dd6b20", lambda r: r["prefill"] or r["joined"])):
            pts = [(xi, r["ms"]) for xi, r in zip(x, steps) if pick(r)]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, color=color, label=f"{kind} ({len(pts)})")
        ax.axhline(50, color="grey", lw=0.8, ls="--")
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xlim(left=0)
        ax.set_yscale("log")
        ax.set_xlabel(f"seconds since the engine woke from {IDLE_MS:.0f}+ ms idle")
        ax.set_ylabel("step (ms)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("Engine steps of a --max-batch 8 server through issue 22's HTTP runs (H200; 50 ms dashed)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
