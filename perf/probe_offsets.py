"""Which offset form for K-quant minimums (Q4_K: ``x = d*sc*q - dmin*m`` per 32 elements) keeps the error lowest,
and what each costs in ONNX Runtime's MatMulNBits on this CPU. A one-off probe (docs/perf/gemma3.md).

Every form stores the same exact weights; they differ in what MatMulNBits' int8 activation quantization
(accuracy_level 4: activations rounded to int8 per block of 32) multiplies:
  zp8     codes against the default zero point 8, exact offset ``-dmin*m + 8*d*sc`` added in float32 as
          ``blocksum(x) @ offsets.T`` (what engine.builder does);
  zp0     an explicit zero point 0 (uint8 tensor) and offset ``-dmin*m``: the codes are not centred;
  zpmean  a per-block uint8 zero point at the block's mean code, offset ``-dmin*m + zp*d*sc``;
  fzp     a float zero point ``dmin*m / (d*sc)`` folding the offset into MatMulNBits (no correction; not exact
          in float32, and ONNX Runtime's slow path).
Error: the int8-activation rounding simulated in numpy (float64) on the real Gemma 3 Q4_K tensors, relative
RMS against the exact product. Speed: MatMulNBits (+ the correction) per form, M=1, interleaved rounds.

    .venv/bin/python -m perf.probe_offsets --gguf .cache/gguf/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from engine.builder.ggml_quants import from_q4_k
from engine.builder.gguf_reader import open_gguf
from engine.builder.quant import unpack


def int8_blocks(a: np.ndarray, block: int = 32) -> np.ndarray:
    """MLAS's activation quantization at accuracy level 4: per block, scale max|a|/127, round to nearest."""
    blocks = a.reshape(a.shape[0], -1, block)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / 127.0
    q = np.rint(blocks / np.where(scale == 0, 1, scale))
    return (q * scale).reshape(a.shape)


def form_errors(w, a: np.ndarray) -> dict[str, float]:
    """Relative RMS error of y = a @ W.T for each offset form (int8 activations in the MatMulNBits part)."""
    q = unpack(w.packed, 4).astype(np.float64)  # [N, nb, 32]
    s = w.scales.astype(np.float64)[..., None]
    o = (w.offsets - 8.0 * w.scales.astype(np.float64))[..., None]  # -dmin*m
    exact = (s * q + o).reshape(w.shape)
    y = a @ exact.T
    aq = int8_blocks(a)
    bsum = a.reshape(a.shape[0], -1, 32).sum(-1)  # [M, nb], float: the correction's input
    out = {}
    zmean = np.clip(np.rint(q.mean(-1, keepdims=True)), 0, 15)
    for name, zp in (("zp8", 8.0), ("zp0", 0.0), ("zpmean", zmean)):
        part = (s * (q - zp)).reshape(w.shape)
        offset = (o + zp * s)[..., 0]  # [N, nb]
        approx = aq @ part.T + bsum @ offset.T
        out[name] = float(np.sqrt(np.mean((approx - y) ** 2)) / np.sqrt(np.mean(y ** 2)))
    fzp = -o / np.where(s == 0, 1, s)  # float zero point: s*(q - fzp) = s*q + o, all through int8 activations
    approx = aq @ (s * (q - fzp.astype(np.float32))).reshape(w.shape).T
    out["fzp"] = float(np.sqrt(np.mean((approx - y) ** 2)) / np.sqrt(np.mean(y ** 2)))
    return out


def timings(w, rounds: int, threads: int) -> dict[str, float]:
    """Microseconds per M=1 call of MatMulNBits for each form (+ blocksum MatMul where there is one)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, k = w.shape
    nb = k // 32
    q = unpack(w.packed, 4)
    zmean = np.clip(np.rint(q.mean(-1)), 0, 15).astype(np.uint8)  # [N, nb]
    packed_z = lambda z: (z[:, 0::2] | (z[:, 1::2] << 4)) if nb % 2 == 0 else None  # noqa: E731
    o = (w.offsets - 8.0 * w.scales.astype(np.float64)).astype(np.float32)
    forms = {"zp8": (None, w.offsets), "zp0": (packed_z(np.zeros((n, nb), np.uint8)), o),
             "zpmean": (packed_z(zmean), o + zmean * w.scales),
             "fzp": ((-o / np.where(w.scales == 0, 1, w.scales)).reshape(-1).astype(np.float32), None)}
    sessions = {}
    for name, (zp, offsets) in forms.items():
        inits = [numpy_helper.from_array(w.packed, "B"), numpy_helper.from_array(w.scales.reshape(-1), "S")]
        inputs = ["A", "B", "S"]
        if zp is not None:
            inits.append(numpy_helper.from_array(zp, "Z"))
            inputs.append("Z")
        nodes = [helper.make_node("MatMulNBits", inputs, ["Y0" if offsets is not None else "Y"], domain="com.microsoft",
                                  K=k, N=n, bits=4, block_size=32, accuracy_level=4)]
        if offsets is not None:
            inits += [numpy_helper.from_array(np.array([0, 0, nb, 32], np.int64), "shape"),
                      numpy_helper.from_array(np.array([-1], np.int64), "axes"),
                      numpy_helper.from_array(np.asarray(offsets, np.float32).T.copy(), "OT")]
            nodes += [helper.make_node("Reshape", ["A", "shape"], ["Ab"]),
                      helper.make_node("ReduceSum", ["Ab", "axes"], ["bs"], keepdims=0),
                      helper.make_node("MatMul", ["bs", "OT"], ["corr"]),
                      helper.make_node("Add", ["Y0", "corr"], ["Y"])]
        graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 1, k])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        sessions[name] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    a = np.random.default_rng(0).normal(size=(1, 1, k)).astype(np.float32)
    per: dict[str, list[float]] = {name: [] for name in sessions}
    for r in range(rounds):
        for name, sess in sessions.items():
            calls = 20 if name == "fzp" else 400
            for _ in range(5):
                sess.run(None, {"A": a})
            t0 = time.perf_counter()
            for _ in range(calls):
                sess.run(None, {"A": a})
            per[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(v) for name, v in per.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--tensors", type=int, default=6, help="Q4_K tensors to use (errors averaged)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model = open_gguf(args.gguf)
    q4k = [t for t in model.tensors.values() if t.tensor_type.name == "Q4_K"][: args.tensors]
    rng = np.random.default_rng(1)
    errors: dict[str, list[float]] = {}
    for t in q4k:
        w = from_q4_k(t.data, int(t.shape[1]), int(t.shape[0]))
        a = rng.normal(size=(16, w.shape[1]))  # 16 activation rows, roughly RMS-normed hidden states
        for name, err in form_errors(w, a).items():
            errors.setdefault(name, []).append(err)
    first = from_q4_k(q4k[0].data, int(q4k[0].shape[1]), int(q4k[0].shape[0]))
    report = {"tensors": [t.name for t in q4k], "relative_rms_error": {k: float(np.mean(v)) for k, v in errors.items()},
              "us_per_call_m1": timings(first, args.rounds, args.threads), "shape": list(first.shape)}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
