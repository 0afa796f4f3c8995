"""Does a row's MatMulNBits result depend on how many rows run with it? (issue 44)

One MatMulNBits node (4-bit, block 32) on the CPU EP: row 0 computed alone (M=1, a lone decode step) against the
same row among M-1 others (a decode batch, a draft check, a prompt chunk), and among M >= 2 against M = 2. Prints
the largest absolute difference per M, per accuracy level and shape, as JSON. ``--qemu-cpu MODEL`` runs the same
probe again under ``qemu-x86_64 -cpu MODEL`` (Debian's qemu-user; EPYC-Rome: AVX2 without AVX-512), so one machine
shows both kinds of CPU. Findings: docs/perf/kernel-rows.md.

    python -m perf.kernel_rows --qemu-cpu EPYC-Rome --json docs/perf/kernel-rows.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SHAPES = ((576, 1536), (1536, 576), (64, 128))  # SmolLM2-135M's FFN up and down; the tests' tiny model
ROWS = (2, 3, 4, 8, 16, 64)


def _session(k: int, n: int, accuracy_level: int, rng: np.random.Generator):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    block = 32
    weights = rng.integers(0, 256, size=(n, k // block, block // 2), dtype=np.uint8)
    scales = (rng.random(n * (k // block), dtype=np.float32) * 0.02).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                              initializer=[numpy_helper.from_array(weights, "B"), numpy_helper.from_array(scales, "S")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # what the installed onnxruntime reads
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def probe() -> dict:
    """{"k x n": {"accuracy_level": {"alone_vs_M": {M: max |diff|}, "M2_vs_M": {M: max |diff|}}}}"""
    rng = np.random.default_rng(0)
    found: dict = {}
    for k, n in SHAPES:
        for level in (4, 0):
            session = _session(k, n, level, rng)
            a = (rng.standard_normal((max(ROWS), k)) * 3).astype(np.float32)
            rows = {m: session.run(None, {"A": a[:m]})[0][0] for m in (1, *ROWS)}
            found.setdefault(f"{k}x{n}", {})[str(level)] = {
                "alone_vs_M": {m: float(np.abs(rows[m] - rows[1]).max()) for m in ROWS},
                "M2_vs_M": {m: float(np.abs(rows[m] - rows[2]).max()) for m in ROWS[1:]}}
    return found


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith("avx"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qemu-cpu", help="also run under qemu-x86_64 -cpu MODEL (e.g. EPYC-Rome: AVX2, no AVX-512)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the probe alone, JSON on stdout
    args = parser.parse_args()
    if args.inner:
        print(json.dumps(probe()))
        return
    results = {"native": {"cpu_avx_flags": cpu_flags(), "rows": probe()}}
    if args.qemu_cpu:
        out = subprocess.run(["qemu-x86_64", "-cpu", args.qemu_cpu, sys.executable, "-m", "perf.kernel_rows", "--inner"],
                             capture_output=True, text=True, check=True)
        results[f"qemu {args.qemu_cpu}"] = {"rows": json.loads(out.stdout.strip().splitlines()[-1])}
    text = json.dumps(results, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
