"""Which way of bringing a captured WebGPU decode step's logits to the CPU is fastest and still correct.

A diagnostic for the device machine (the Runner alone, no engine threads). Writes readback.json to --out.
    python3 -m perf.gpu.probe_readback --out $OUT

Variants, each after the same captured replay:
- ``copy_outputs_to_cpu``: the readback IOBinding's own copy (the engine's path; a fresh array per step);
- ``copy_tensors``: ``onnxruntime.copy_tensors`` into one preallocated CPU OrtValue, right after the run;
- ``sync_copy_tensors``: the same after ``IOBinding.synchronize_outputs()`` on the decode binding.
Correctness: each variant's logits must equal ``copy_outputs_to_cpu`` taken in the same step (a stale
readback shows up as a mismatch), with the step's inputs changing every step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from perf.gpu.probe_step import decode_ready_runner
from engine.graph_capture import PACKED_INPUT


def _step(runner, binding, i: int, batch: int) -> None:
    rows = np.arange(batch)
    runner.decode_ids[:, 0] = (5 + 7 * i + rows) % 1000
    runner.decode_pos[:, 0] = 4 + i
    runner._set_ones(rows, np.full(batch, 5 + i))
    if runner._packed is not None:
        runner._packed[:, 0] = runner.decode_ids[:, 0]
        runner._packed[:, 1] = runner.mask_ones - 1
    runner.device_io.upload()
    runner.session.run_with_iobinding(binding)


def probe(model: Path, batch: int, kv_length: int, steps: int, provider: str = "webgpu") -> dict[str, Any]:
    runner, binding = decode_ready_runner(model, {}, True, packed=True, batch=batch, kv_length=kv_length,
                                          provider=provider)
    dio = runner.device_io
    host = np.empty(tuple(dio.logits.shape()), dtype=np.float32)
    host_value = ort.OrtValue.ortvalue_from_numpy(host)

    def read(variant: str) -> np.ndarray:
        if variant == "copy_outputs_to_cpu":
            return dio.read_logits()
        if variant == "sync_copy_tensors":
            binding.synchronize_outputs()
        ort.copy_tensors([dio.logits], [host_value])
        return host

    out: dict[str, Any] = {"batch": batch, "kv_length": kv_length}
    for variant in ("copy_outputs_to_cpu", "copy_tensors", "sync_copy_tensors"):
        mismatches, max_diff, times = 0, 0.0, []
        for i in range(steps):
            _step(runner, binding, i, batch)
            t0 = time.perf_counter()
            got = read(variant)
            times.append(time.perf_counter() - t0)
            ref = dio.read_logits()
            diff = float(np.max(np.abs(got - ref)))
            max_diff = max(max_diff, diff)
            mismatches += int(diff > 0)
        # Timing without the checking readback in between (what a step would pay).
        clean = []
        for i in range(steps):
            _step(runner, binding, steps + i, batch)
            t0 = time.perf_counter()
            got = read(variant)
            np.argmax(got[:, 0], axis=-1)
            clean.append(time.perf_counter() - t0)
        out[variant] = {"read_ms_median": float(np.median(times) * 1e3),
                        "read_plus_argmax_ms_median": float(np.median(clean) * 1e3),
                        "steps_mismatched": mismatches, "max_abs_diff": max_diff, "steps": steps}
        print(model.name, batch, variant, out[variant], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", type=Path, default=Path("/tmp/ortserve_gpu_models"))
    args = p.parse_args(argv)
    from perf.gpu.shapes import SHAPES
    from engine.builder import SyntheticSpec, build_synthetic

    data: dict[str, Any] = {"onnxruntime": ort.__version__, "packed_input": PACKED_INPUT}
    path = args.models / "llama-3.2-1b"
    if not (path / "model.onnx").is_file():
        build_synthetic(path, SyntheticSpec(**SHAPES["llama-3.2-1b"], max_length=512, quant="int4",
                                            dtype="float16"), accuracy_level=4)
    for batch, kv_length, steps in ((1, 512, 60), (64, 256, 20)):
        try:
            data[f"b{batch}"] = probe(path, batch, kv_length, steps)
        except Exception as exc:  # noqa: BLE001
            data[f"b{batch}"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
            print(batch, data[f"b{batch}"], flush=True)
        (args.out / "readback.json").write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
