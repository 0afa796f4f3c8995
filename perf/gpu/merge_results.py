"""Merge the GPU runs' JSON (engine bench, PyTorch reference, step probes) into one report and redraw the plot.

Runs here (no GPU): python -m perf.gpu.merge_results --bench gpu_bench.json --torch torch_ref.json
    --probe probe.json [--probe probe2.json] --out docs/perf/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from perf.gpu.bench_gpu import int4_bytes_per_token, plot
from perf.gpu.shapes import HBM_BYTES_PER_S, OUTPUT_TOKENS, PROMPT_TOKENS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", type=Path, required=True)
    p.add_argument("--torch", type=Path)
    p.add_argument("--probe", type=Path, action="append", default=[])
    p.add_argument("--models", type=Path, help="model folders to recompute the bandwidth bound from")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    data: dict[str, Any] = json.loads(args.bench.read_text())
    if args.torch:
        torch = json.loads(args.torch.read_text())
        for name, figures in torch.get("shapes", {}).items():
            data["shapes"].setdefault(name, {})["torch"] = figures
        data["torch_meta"] = {k: v for k, v in torch.items() if k != "shapes"}
    for path in args.probe:
        probe = json.loads(path.read_text())
        for key, value in probe.items():
            data.setdefault("probe", {})[key] = value
    for name, entry in data["shapes"].items():
        if args.models and (args.models / name / "model.onnx").is_file():
            nbytes = int4_bytes_per_token(args.models / name, PROMPT_TOKENS + OUTPUT_TOKENS // 2)
            entry["bound"].update(int4_bytes_per_token=nbytes, int4_tokens_per_s=HBM_BYTES_PER_S / nbytes["total"])
        ours = entry.get("engine", {}).get("capture", {}).get("decode_tokens_per_s")
        ratios = {}
        for key in ("eager", "static_compile"):
            theirs = entry.get("torch", {}).get(key, {}).get("decode_tokens_per_s")
            if ours and theirs:
                ratios[f"vs_torch_{key}"] = ours / theirs
        if ours:
            ratios["of_int4_bound"] = ours / entry["bound"]["int4_tokens_per_s"]
            ratios["vs_prototype"] = ours / entry["bound"]["prototype_webgpu"]
        entry["ratios"] = ratios
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(json.dumps(data, indent=2))
    plot(data, args.out / "gpu_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
