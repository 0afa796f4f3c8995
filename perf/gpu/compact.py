"""One device call's results as a compact record: each `ortserve bench` run's throughput, TTFT and ITL (from
serving.sh's serving.json) and each phases run's ms per step (from issue22.sh's phases step).

    python -m perf.gpu.compact RESULTS_DIR [--what TEXT] [--phases-only]  -> JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def http_runs(serving: Path) -> dict[str, Any]:
    """name -> the figures of its first level (serving.json: one report per run)."""
    def r(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    out = {}
    for name, report in json.loads(serving.read_text()).items():
        s = report["runs"][0]["summary"]
        out[name] = {"output_tok_s": r(s["output_tokens_per_s"], 1), "ttft_p50_ms": r(s["ttft"]["p50_ms"], 1),
                     "itl_p50_ms": r(s["itl"]["p50_ms"], 2), "itl_p99_ms": r(s["itl"]["p99_ms"], 2),
                     "itl_max_ms": r(s["itl"]["max_ms"], 1), "tpot_p50_ms": r(s["tpot"]["p50_ms"], 2),
                     "num_ok": s["num_ok"], "num_requests": s["num_requests"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="an unpacked issue22.tgz")
    p.add_argument("--what", default="")
    args = p.parse_args(argv)
    record: dict[str, Any] = {"what": args.what}
    for serving in sorted(args.results.glob("*/serving.json")):
        record.setdefault("http", {})[serving.parent.name] = http_runs(serving)
    for phases in sorted(args.results.glob("phases/*-phases.json")):
        record.setdefault("phases", {})[phases.name.removesuffix("-phases.json")] = json.loads(phases.read_text())
    b1 = record.get("http", {}).get("cuda-spec0", {}).get("b1-c1", {}).get("output_tok_s")
    if b1:
        runs = record["http"]["cuda-spec0"]
        record["ratios_vs_b1_c1"] = {k: round(v["output_tok_s"] / b1, 2) for k, v in runs.items()
                                     if k in ("b8-c1", "b8-c8", "b64-c64")}
    json.dump(record, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
