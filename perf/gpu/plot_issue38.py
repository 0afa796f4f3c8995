"""Issue 38's plot: ortserve against llama-server (CUDA, the same GGUF) at 1, 8 and 64 streams with the ~700-token
TTFT and 64 arrivals, and one stream with drafts on and off on each model. Reads perf/gpu/issue38.sh's issue38.json
(reports), or docs/perf/issue38/results.json (the runs' summary lines by call: the peer call, the speculation calls).

    python -m perf.gpu.plot_issue38 docs/perf/issue38/results.json docs/perf/gpu_issue38.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


# results.json: the calls whose runs the plot shows (the spec panel's never-hit model from the centred-code call)
RESULT_GROUPS = {"peer_and_arrivals": "", "spec_offset_codes_fixed_cost_model": "", "spec_centred_codes": "centred-"}


def figure(reports: dict) -> dict[str, dict[str, float]]:
    """``{name: {"tok_s", "ttft_p50_ms", "ttft_p99_ms"}}`` of each report's first run (issue38.json), or of the runs of
    ``RESULT_GROUPS`` (results.json; the centred-code call's names prefixed "centred-")."""
    if set(reports) & set(RESULT_GROUPS):
        return {RESULT_GROUPS[g] + name: run for g in RESULT_GROUPS for name, run in reports.get(g, {}).items()}
    out = {}
    for name, report in reports.items():
        if report["runs"]:
            s = report["runs"][0]["summary"]
            t = s.get("ttft") or {}
            out[name] = {"tok_s": s.get("output_tokens_per_s") or 0.0, "ttft_p50_ms": t.get("p50_ms") or 0.0,
                         "ttft_p99_ms": t.get("p99_ms") or 0.0}
    return out


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, dst = (argv or sys.argv[1:])[:2]
    f = figure(json.loads(Path(src).read_text()))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    levels = [("c1", "1 stream"), ("c8", "8 streams"), ("c64", "64 streams")]
    x = range(len(levels))
    for i, (who, colour) in enumerate((("peer", "tab:gray"), ("ours", "tab:blue"))):
        vals = [f.get(f"{who}-{k}", {}).get("tok_s", 0.0) for k, _ in levels]
        axes[0].bar([v + 0.4 * i for v in x], vals, 0.4, color=colour,
                    label="llama-server (CUDA)" if who == "peer" else "ortserve")
    axes[0].set_xticks([v + 0.2 for v in x], [label for _, label in levels])
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("same GGUF, through HTTP")
    axes[0].legend()
    cases = [("ttft-idle", "~700 tokens, idle"), ("ttft-busy", "beside 7 streams")] + \
        [(f"arrivals{i}", f"64 at once ({i})") for i in (1, 2, 3)]
    for i, (who, colour) in enumerate((("peer", "tab:gray"), ("ours", "tab:blue"))):
        vals = [f.get(f"{who}-{k}", {}).get("ttft_p50_ms", 0.0) for k, _ in cases]
        axes[1].bar([v + 0.4 * i for v in range(len(cases))], vals, 0.4, color=colour)
    axes[1].set_xticks([v + 0.2 for v in range(len(cases))], [label for _, label in cases], rotation=20, fontsize=8)
    axes[1].set_ylabel("TTFT p50 (ms)")
    axes[1].set_title("time to first token")
    spec = [("synthetic-%s-greedy", "synthetic 1B\n(NaN logits)"), ("gguf-%s-greedy", "offset codes, tied\n(drafts hit)"),
            ("centred-gguf-untied-%s-greedy", "centred codes\n(drafts miss)")]
    for i, (mode, colour) in enumerate((("spec0", "tab:gray"), ("default", "tab:blue"))):
        vals = [f.get(k.replace("%s", mode).replace("centred-", "centred-spec-") if k.startswith("centred-")
                      else "spec-" + k % mode, {}).get("tok_s", 0.0) for k, _ in spec]
        axes[2].bar([v + 0.4 * i for v in range(len(spec))], vals, 0.4, color=colour,
                    label="--speculative-tokens 0" if mode == "spec0" else "default (drafts)")
    axes[2].set_xticks([v + 0.2 for v in range(len(spec))], [label for _, label in spec], fontsize=8)
    axes[2].set_ylabel("one stream, output tokens/s")
    axes[2].set_title("drafts: bounded cost")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
