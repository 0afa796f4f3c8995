"""What a KV row copy costs on an opaque-buffer device (WebGPU), by the form of the copy graph (issue 22).

The engine's row copier (``engine.device_kv.RowCopier``: Gather + ScatterND with one index per row) was measured
at ~90 MB/s on an H200. This times candidate graphs on the same buffers (every layer's key and value buffer
``[slots, H, L, D]``, one run copying one row of each), each followed by a one-element read that waits for the
device, minus that read alone:
  * ``row``: the engine's graph (ScatterND, indices ``[1, 1]``: one index writes a whole row);
  * ``fine``: ScatterND with indices ``[H * L, 3]`` (one index per (head, position): D elements each);
  * ``held``: ``fine`` over the positions ``[0, n)`` a row holds only (indices ``[H * n, 3]``, given per copy);
  * ``where``: ``Where(row == dst_row, src_row, dst)`` over the whole destination buffer, written in place.
Each variant's result is checked against numpy.

    python -m perf.gpu.probe_copy --provider webgpu --out probe_copy.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from perf.gpu.probe_cuda import _median_ms


def _graph(variant: str, n_buf: int, shape: tuple[int, int, int, int], dtype: Any) -> bytes:
    slots, heads, length, head = shape
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inputs, outputs, inits = [], [], [], []
    dims = [slots, heads, length, head]
    inputs += [helper.make_tensor_value_info("src_row", TensorProto.INT64, [1]),
               helper.make_tensor_value_info("dst_row", TensorProto.INT64, [1, 1])]
    if variant == "fine":
        h, pos = np.meshgrid(np.arange(heads), np.arange(length), indexing="ij")
        inits.append(numpy_helper.from_array(np.stack([h.ravel(), pos.ravel()], 1).astype(np.int64), "hl"))
        inits.append(numpy_helper.from_array(np.array([heads * length, 1], np.int64), "col_shape"))
        inits.append(numpy_helper.from_array(np.array([heads * length, head], np.int64), "upd_shape"))
        nodes += [helper.make_node("Expand", ["dst_row", "col_shape"], ["rows_col"]),
                  helper.make_node("Concat", ["rows_col", "hl"], ["idx"], axis=1)]
    if variant == "held":
        inputs.append(helper.make_tensor_value_info("idx", TensorProto.INT64, ["m", 3]))
        inputs.append(helper.make_tensor_value_info("n_pos", TensorProto.INT64, [1]))
        inits.append(numpy_helper.from_array(np.array([0], np.int64), "zero"))
        inits.append(numpy_helper.from_array(np.array([2], np.int64), "axis2"))
        inits.append(numpy_helper.from_array(np.array([-1, head], np.int64), "upd_shape"))
    if variant == "where":
        inits.append(numpy_helper.from_array(np.arange(slots, dtype=np.int64).reshape(slots, 1, 1, 1), "row_ids"))
        nodes.append(helper.make_node("Equal", ["row_ids", "dst_row"], ["is_dst"]))
    for i in range(n_buf):
        src, dst, row, out = f"src_{i}", f"dst_{i}", f"row_{i}", f"out_{i}"
        inputs += [helper.make_tensor_value_info(src, elem, dims), helper.make_tensor_value_info(dst, elem, dims)]
        outputs.append(helper.make_tensor_value_info(out, elem, dims))
        nodes.append(helper.make_node("Gather", [src, "src_row"], [row], axis=0))  # [1, H, L, D]
        if variant == "row":
            nodes.append(helper.make_node("ScatterND", [dst, "dst_row", row], [out]))
        elif variant == "fine":
            nodes += [helper.make_node("Reshape", [row, "upd_shape"], [f"upd_{i}"]),
                      helper.make_node("ScatterND", [dst, "idx", f"upd_{i}"], [out])]
        elif variant == "held":
            nodes += [helper.make_node("Slice", [row, "zero", "n_pos", "axis2"], [f"part_{i}"]),
                      helper.make_node("Reshape", [f"part_{i}", "upd_shape"], [f"upd_{i}"]),
                      helper.make_node("ScatterND", [dst, "idx", f"upd_{i}"], [out])]
        elif variant == "where":
            nodes.append(helper.make_node("Where", ["is_dst", row, dst], [out]))
    graph = helper.make_graph(nodes, f"copy_{variant}", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _read_graph(shape: tuple[int, ...], dtype: Any, whole: bool) -> bytes:
    """x -> one element (a read that waits for the device), or the whole buffer (the correctness check)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array(np.zeros(4, np.int64), "s"), numpy_helper.from_array(np.ones(4, np.int64), "e")]
    node = helper.make_node("Identity", ["x"], ["y"]) if whole else helper.make_node("Slice", ["x", "s", "e"], ["y"])
    graph = helper.make_graph([node], "read", [helper.make_tensor_value_info("x", elem, list(shape))],
                              [helper.make_tensor_value_info("y", elem, list(shape) if whole else [1, 1, 1, 1])],
                              [] if whole else inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="webgpu")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--held", type=int, default=120, help="positions a row holds (the 'held' variant)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--variants", default="row,fine,held,where")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from ep import device as ep_device
    from ep import host_memory
    from ep import providers as ep_providers

    selected = ep_device.select_device(args.provider)
    shape = (args.slots, args.heads, args.length, args.head_size)
    dtype = np.float16
    n_buf = 2 * args.layers

    def session(model: bytes) -> ort.InferenceSession:
        so = ep_providers.make_session_options(selected, {"model": {}}) if selected.ep_device is not None \
            else ort.SessionOptions()
        return ep_providers.create_session(model, selected, so)

    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape).astype(dtype) for _ in range(n_buf)]
    bufs = [host_memory.alloc_device(shape, dtype, selected) for _ in range(n_buf)]
    on_device = selected.default_memory is not None

    def upload():
        for h, b in zip(host, bufs):
            if on_device:
                ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(h)], [b])
            else:
                b.update_inplace(h)

    reader = session(_read_graph(shape, dtype, whole=False))
    rb = reader.io_binding()
    rb.bind_ortvalue_input("x", bufs[0])
    rb.bind_output("y")

    def wait() -> None:
        reader.run_with_iobinding(rb)
        rb.copy_outputs_to_cpu()

    whole = session(_read_graph(shape, dtype, whole=True))

    def read_all(i: int) -> np.ndarray:
        wb = whole.io_binding()
        wb.bind_ortvalue_input("x", bufs[i])
        wb.bind_output("y")
        whole.run_with_iobinding(wb)
        return wb.copy_outputs_to_cpu()[0]

    def median_ms(fn) -> float:
        return _median_ms(fn, args.repeat, warm=1)

    result: dict[str, Any] = {"provider": selected.ep_name, "shape": shape, "buffers": n_buf,
                              "row_mb_per_copy": round(n_buf * np.prod(shape[1:]) * 2 / 1e6, 1),
                              "held_positions": args.held}
    upload()
    result["wait_alone_ms"] = round(median_ms(wait), 3)
    src_row, dst_row = 1, args.slots - 1
    h_idx, p_idx = np.meshgrid(np.arange(args.heads), np.arange(args.held), indexing="ij")
    held_idx = np.stack([np.full(h_idx.size, dst_row), h_idx.ravel(), p_idx.ravel()], 1).astype(np.int64)
    for variant in args.variants.split(","):
        entry: dict[str, Any] = {}
        try:
            t0 = time.perf_counter()
            s = session(_graph(variant, n_buf, shape, dtype))
            entry["load_s"] = round(time.perf_counter() - t0, 2)
            binding = s.io_binding()
            for i, b in enumerate(bufs):
                binding.bind_ortvalue_input(f"src_{i}", b)
                binding.bind_ortvalue_input(f"dst_{i}", b)
                binding.bind_ortvalue_output(f"out_{i}", b)
            binding.bind_cpu_input("src_row", np.array([src_row], np.int64))
            binding.bind_cpu_input("dst_row", np.array([[dst_row]], np.int64))
            if variant == "held":
                binding.bind_cpu_input("idx", held_idx)
                binding.bind_cpu_input("n_pos", np.array([args.held], np.int64))
            upload()
            wait()
            s.run_with_iobinding(binding)  # the first run compiles
            wait()
            got = read_all(0)
            want = host[0].copy()
            if variant == "held":
                want[dst_row, :, :args.held] = host[0][src_row, :, :args.held]
            else:
                want[dst_row] = host[0][src_row]
            entry["correct"] = bool(np.array_equal(got, want))
            got_last = read_all(n_buf - 1)
            entry["correct_last_buffer"] = bool(np.array_equal(got_last[dst_row, :, :args.held],
                                                               host[-1][src_row, :, :args.held]))

            def copy_and_wait():
                s.run_with_iobinding(binding)
                wait()
            entry["copy_call_ms"] = round(median_ms(lambda: s.run_with_iobinding(binding)), 3)
            wait()
            entry["copy_and_wait_ms"] = round(median_ms(copy_and_wait), 3)
            entry["copy_ms"] = round(entry["copy_and_wait_ms"] - result["wait_alone_ms"], 3)
            moved = result["row_mb_per_copy"] * (args.held / args.length if variant == "held" else 1.0)
            entry["mb_per_s"] = round(moved / max(entry["copy_ms"], 1e-3) * 1e3)
        except Exception as exc:  # noqa: BLE001 - a probe: record why a variant failed
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        result[variant] = entry
        print(json.dumps({variant: entry}), flush=True)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
