"""What the CUDA EP allows once KV rows are addressed by pointer (issue 22): bare session steps, no engine.

Times, on one session of a model folder, with every layer's KV in one ``[slots, H, L, D]`` device buffer bound
by address + row offset (past and present the same memory):
  * a decode step over rows ``[0, b)`` for each batch b (inputs and logits in host memory, or inputs in the
    device's HOST_ACCESSIBLE memory), with the attention mask as wide as the KV buffer or as the longest row;
  * the same step with its logits left on the device (the run alone) and their copy to the host;
  * a CUDA-graph replay per bucket (``enable_cuda_graph``, one ``gpu_graph_id`` per bucket) of the captured
    graph that engine.graph_capture builds (packed decode input, constant total length);
  * a prefill of a ~900-token prompt in chunks, straight into row 5;
  * a whole-row KV copy between slots by a graph of Identity nodes bound by address;
  * argmax and the engine's sampler over ``[b, vocab]`` float32 logits on the CPU.
Checks that the rows bound by address give bit-identical KV and logits to a batch-1 run on buffers of their own.

    python -m perf.gpu.probe_cuda --model DIR --out probe_cuda.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.config import EngineConfig
from engine.graph_capture import PACKED_INPUT, capture_graph_bytes, nodes_off_ep
from engine.model_loader import check_graph, create_session, read_model_folder


def _median_ms(fn: Callable[[], Any], repeat: int, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


class Rows:
    """KV buffers in device memory and address views of their rows."""

    def __init__(self, selected: Any, layers: int, slots: int, heads: int, length: int, head: int, dtype: Any):
        from ep import host_memory

        self.shape = (slots, heads, length, head)
        self.dtype = np.dtype(dtype)
        self.row_bytes = heads * length * head * self.dtype.itemsize
        self.keys = [host_memory.alloc_device(self.shape, dtype, selected, zero=True) for _ in range(layers)]
        self.values = [host_memory.alloc_device(self.shape, dtype, selected, zero=True) for _ in range(layers)]
        self.device = ("cpu" if selected.default_memory is None else "cuda", selected.device_id)

    def bind(self, binding: ort.IOBinding, io: Any, lo: int, hi: int) -> None:
        dtype, (dev, dev_id) = self.dtype.type, self.device
        shape = [hi - lo, *self.shape[1:]]
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            for past, present, value in ((io.past_keys[i], io.present_keys[i], k),
                                         (io.past_values[i], io.present_values[i], v)):
                ptr = value.data_ptr() + lo * self.row_bytes
                binding.bind_input(past, dev, dev_id, dtype, shape, ptr)
                binding.bind_output(present, dev, dev_id, dtype, shape, ptr)

    def read_row(self, layer: int, slot: int) -> np.ndarray:
        """One row of a layer's key buffer, on the host (through the whole buffer: a probe, not a hot path)."""
        if self.device[0] == "cpu":
            return self.keys[layer].numpy()[slot].copy()
        host = ort.OrtValue.ortvalue_from_numpy(np.zeros(self.shape, dtype=self.dtype))
        ort.copy_tensors([self.keys[layer]], [host])
        return host.numpy()[slot].copy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=900)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--provider", default="cuda", help="cuda (cpu: a dry run of the probe itself)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from ep import device as ep_device

    folder = read_model_folder(args.model)
    config = EngineConfig(provider=args.provider, max_batch=args.slots)
    selected = ep_device.select_device(args.provider)
    result: dict[str, Any] = {"device": selected.record.to_dict()}
    t0 = time.perf_counter()
    session, _ = create_session(folder, config, selected=selected)
    result["load_s"] = round(time.perf_counter() - t0, 2)
    io = check_graph(folder, session)
    length = io.kv_length or folder.search_max_length or 1024
    vocab = io.vocab_size
    rows = Rows(selected, folder.num_layers, args.slots, folder.num_kv_heads, length, folder.head_size, io.kv_dtype)
    result.update(kv_length=length, vocab=vocab, kv_mib=round(2 * folder.num_layers * args.slots * rows.row_bytes / 2**20))
    print(json.dumps(result), flush=True)
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    mask = np.zeros((args.slots, length), dtype=np.int64)
    mask[:, :61] = 1  # every row holds 60 positions, the new token goes at 60
    ids = rng.integers(3, vocab, (args.slots, 1)).astype(np.int64)
    pos = np.full((args.slots, 1), 60, dtype=np.int64)
    logits = np.zeros((args.slots, 1, vocab), dtype=np.float32)
    pinned = {}
    if selected.host_accessible_memory is not None:
        from ep import host_memory
        for name, a in (("ids", ids), ("pos", pos), ("mask", mask)):
            buf = host_memory.alloc_host_accessible(a.shape, a.dtype, selected)
            if buf is not None:
                buf.array[...] = a
                pinned[name] = buf
        logits_buf = host_memory.alloc_host_accessible(logits.shape, np.float32, selected)
        if logits_buf is not None:
            pinned["logits"] = logits_buf
    result["host_accessible"] = sorted(pinned)

    def decode_binding(b: int, *, narrow: bool, use_pinned: bool, logits_on_device: Any = None) -> ort.IOBinding:
        binding = session.io_binding()
        src = {n: (pinned[n].array if use_pinned and n in pinned else a)
               for n, a in (("ids", ids), ("pos", pos), ("mask", mask))}
        width = 61 if narrow else length
        m = np.ascontiguousarray(src["mask"][:b, :width]) if narrow else src["mask"][:b]
        binding.bind_cpu_input(io.input_ids, src["ids"][:b])
        if io.position_ids:
            binding.bind_cpu_input(io.position_ids, src["pos"][:b])
        binding.bind_cpu_input(io.attention_mask, m)
        if logits_on_device is not None:
            binding.bind_ortvalue_output(io.logits, logits_on_device)
        else:
            out = pinned["logits"].array if use_pinned and "logits" in pinned else logits
            binding.bind_ortvalue_output(io.logits, ort.OrtValue.ortvalue_from_numpy(out[:b]))
        rows.bind(binding, io, 0, b)
        return binding

    from ep import host_memory
    steps: dict[str, Any] = {}
    for b in batches:
        entry = {}
        for label, narrow, use_pinned in (("full_mask", False, False), ("narrow_mask", True, False),
                                          ("full_mask_pinned", False, True), ("narrow_mask_pinned", True, True)):
            if use_pinned and not pinned:
                continue
            try:
                binding = decode_binding(b, narrow=narrow, use_pinned=use_pinned)
                entry[label] = _median_ms(lambda binding=binding: session.run_with_iobinding(binding), args.repeat)
            except Exception as exc:  # noqa: BLE001 - a probe: record why
                entry[label] = f"{type(exc).__name__}: {exc}"[:300]
        dev_logits = host_memory.alloc_device((b, 1, vocab), np.float32, selected)
        binding = decode_binding(b, narrow=True, use_pinned=False, logits_on_device=dev_logits)

        def run_sync(binding=binding):
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()
        entry["narrow_logits_on_device"] = _median_ms(run_sync, args.repeat)
        host_logits = ort.OrtValue.ortvalue_from_numpy(np.zeros((b, 1, vocab), dtype=np.float32))
        if selected.default_memory is not None:
            entry["logits_to_host"] = _median_ms(lambda: ort.copy_tensors([dev_logits], [host_logits]), args.repeat)
        if "logits" in pinned:
            ph = ort.OrtValue.ortvalue_from_numpy(pinned["logits"].array[:b])
            entry["logits_to_pinned"] = _median_ms(lambda ph=ph: ort.copy_tensors([dev_logits], [ph]), args.repeat)
        host = np.random.default_rng(1).standard_normal((b, vocab)).astype(np.float32)
        entry["argmax_cpu"] = _median_ms(lambda host=host: host.argmax(axis=1), args.repeat)
        steps[b] = entry
        print(json.dumps({f"decode_b{b}": entry}), flush=True)
    result["decode_ms"] = steps

    # Sampler over the logits as the core would run it (temperature 0 and 1, top_p 1).
    from engine.sampler import RequestSampler, sample_batch
    from engine.types import SamplingParams
    sampling: dict[str, Any] = {}
    for b in batches:
        host = np.random.default_rng(2).standard_normal((b, vocab)).astype(np.float32)
        for temp in (0.0, 1.0):
            samplers = [RequestSampler(SamplingParams(temperature=temp, max_tokens=8), [1, 2, 3], vocab,
                                       np.random.default_rng(i)) for i in range(b)]
            sampling[f"b{b}_t{temp:g}"] = _median_ms(lambda host=host, s=samplers: sample_batch(host, s, None, []),
                                                     max(5, args.repeat // 2))
    result["sample_ms"] = sampling
    print(json.dumps({"sample_ms": sampling}), flush=True)

    # Prefill of a long prompt into row 5 in chunks (row 5 bound alone by address).
    prompt = rng.integers(3, vocab, args.prompt).astype(np.int64)
    prefill: dict[str, Any] = {}
    keep = "logits_to_keep" in {i.name for i in session.get_overridable_initializers()}
    for chunk in (256, 512, 1024):
        def run_prompt(chunk=chunk):
            binding = session.io_binding()
            rows.bind(binding, io, 5, 6)
            last = None
            for start in range(0, len(prompt), chunk):
                part = prompt[start:start + chunk]
                n = len(part)
                binding.bind_cpu_input(io.input_ids, part.reshape(1, n))
                if io.position_ids:
                    binding.bind_cpu_input(io.position_ids, np.arange(start, start + n, dtype=np.int64).reshape(1, n))
                m = np.zeros((1, length), dtype=np.int64)
                m[0, :start + n] = 1
                binding.bind_cpu_input(io.attention_mask, m)
                if keep:
                    binding.bind_ortvalue_input("logits_to_keep", ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.int64)))
                last = np.zeros((1, 1 if keep else n, vocab), dtype=np.float32)
                binding.bind_ortvalue_output(io.logits, ort.OrtValue.ortvalue_from_numpy(last))
                session.run_with_iobinding(binding)
            return last
        prefill[chunk] = _median_ms(run_prompt, 5, warm=1)
    result["prefill_ms"] = {"prompt_tokens": int(args.prompt), **prefill}
    print(json.dumps({"prefill_ms": result["prefill_ms"]}), flush=True)

    # Bit-identity: a request in row 2 of the shared buffer vs the same request alone on [1, ...] buffers.

    def run_request(target: Rows, row: int) -> np.ndarray:
        binding = session.io_binding()
        target.bind(binding, io, row, row + 1)
        n = 40
        binding.bind_cpu_input(io.input_ids, prompt[:n].reshape(1, n))
        if io.position_ids:
            binding.bind_cpu_input(io.position_ids, np.arange(n, dtype=np.int64).reshape(1, n))
        m = np.zeros((1, length), dtype=np.int64)
        m[0, :n] = 1
        binding.bind_cpu_input(io.attention_mask, m)
        if keep:
            binding.bind_ortvalue_input("logits_to_keep", ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.int64)))
        out = np.zeros((1, 1 if keep else n, vocab), dtype=np.float32)
        binding.bind_ortvalue_output(io.logits, ort.OrtValue.ortvalue_from_numpy(out))
        session.run_with_iobinding(binding)
        token = int(out[0, -1].argmax())
        for step in range(8):  # greedy decode steps in the same row
            p = n + step
            m[0, p] = 1
            binding.bind_cpu_input(io.input_ids, np.array([[token]], dtype=np.int64))
            if io.position_ids:
                binding.bind_cpu_input(io.position_ids, np.array([[p]], dtype=np.int64))
            binding.bind_cpu_input(io.attention_mask, m)
            if keep:
                binding.bind_ortvalue_input("logits_to_keep", ort.OrtValue.ortvalue_from_numpy(np.ones(1, dtype=np.int64)))
            out = np.zeros((1, 1, vocab), dtype=np.float32)
            binding.bind_ortvalue_output(io.logits, ort.OrtValue.ortvalue_from_numpy(out))
            session.run_with_iobinding(binding)
            token = int(out[0, -1].argmax())
        return out

    try:
        _identity_and_copy(result, rows, run_request, folder, selected, args)
    except Exception as exc:  # noqa: BLE001 - a probe: record why
        result["identity_or_copy_error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(json.dumps({"identity_or_copy_error": result["identity_or_copy_error"]}), flush=True)
    _graphs(result, folder, selected, rows, io, ids, batches, length, vocab, args)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


def _identity_and_copy(result, rows, run_request, folder, selected, args) -> None:
    solo = Rows(selected, folder.num_layers, 1, rows.shape[1], rows.shape[2], rows.shape[3], rows.dtype)
    before_row3 = rows.read_row(0, 3)
    shared_logits = run_request(rows, 2)
    solo_logits = run_request(solo, 0)
    result["bit_identical"] = {
        "kv_layer0": bool(np.array_equal(rows.read_row(0, 2)[:, :48], solo.read_row(0, 0)[:, :48], equal_nan=True)),
        "logits": bool(np.array_equal(shared_logits, solo_logits, equal_nan=True)),
        "row3_untouched": bool(np.array_equal(before_row3, rows.read_row(0, 3))),
        "logits_finite": bool(np.isfinite(solo_logits).all()),
    }
    print(json.dumps({"bit_identical": result["bit_identical"]}), flush=True)

    # Whole-row copy between slots: a graph of Identity nodes bound by address (one run copies every layer).
    from onnx import helper
    elem = helper.np_dtype_to_tensor_dtype(rows.dtype)
    n_buf = 2 * folder.num_layers
    row_shape = [1, *rows.shape[1:]]
    graph = helper.make_graph(
        [helper.make_node("Identity", [f"src_{i}"], [f"dst_{i}"]) for i in range(n_buf)], "row_copy",
        [helper.make_tensor_value_info(f"src_{i}", elem, row_shape) for i in range(n_buf)],
        [helper.make_tensor_value_info(f"dst_{i}", elem, row_shape) for i in range(n_buf)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    copy_so = ort.SessionOptions()
    if selected.ep_device is not None:
        copy_so.add_provider_for_devices([selected.ep_device], {})
    copy_session = ort.InferenceSession(model.SerializeToString(), copy_so, providers=None if selected.ep_device
                                        else ["CPUExecutionProvider"])
    cb = copy_session.io_binding()
    dev, dev_id = rows.device
    for i, value in enumerate([*rows.keys, *rows.values]):
        cb.bind_input(f"src_{i}", dev, dev_id, rows.dtype.type, row_shape, value.data_ptr() + 2 * rows.row_bytes)
        cb.bind_output(f"dst_{i}", dev, dev_id, rows.dtype.type, row_shape, value.data_ptr() + 7 * rows.row_bytes)

    def copy_sync():
        copy_session.run_with_iobinding(cb)
        cb.synchronize_outputs()
    result["row_copy_identity_ms"] = _median_ms(copy_sync, args.repeat)
    result["row_copy_ok"] = bool(np.array_equal(rows.read_row(0, 7), rows.read_row(0, 2)))
    result["row_copy_mb"] = round(n_buf * rows.row_bytes / 1e6, 1)
    print(json.dumps({k: result[k] for k in ("row_copy_identity_ms", "row_copy_ok", "row_copy_mb")}), flush=True)


def _graphs(result, folder, selected, rows, io, ids, batches, length, vocab, args) -> None:
    from ep import host_memory
    # CUDA graphs: the captured graph (packed input, constant total length), one gpu_graph_id per bucket.
    if not args.no_graphs and args.provider == "cuda":
        graphs: dict[str, Any] = {}
        try:
            gconfig = EngineConfig(provider="cuda", max_batch=args.slots, ep_options={"enable_cuda_graph": "1"})
            names = ("input_ids", "position_ids", "attention_mask")
            gsession, _ = create_session(folder, gconfig, selected=selected, graph_capture=True,
                                         model_bytes=capture_graph_bytes(folder, length, packed=True, names=names))
            graphs["nodes_off_cuda"] = sorted(set(nodes_off_ep(gsession, selected.ep_name)))
            for b in batches:
                packed_host = np.zeros((b, 2), dtype=np.int32)
                packed_host[:, 0] = ids[:b, 0]
                packed_host[:, 1] = 60
                packed_dev = host_memory.alloc_device((b, 2), np.int32, selected)
                glogits = host_memory.alloc_device((b, 1, vocab), np.float32, selected)
                gb = gsession.io_binding()
                gb.bind_ortvalue_input(PACKED_INPUT, packed_dev)
                gb.bind_ortvalue_output(io.logits, glogits)
                rows.bind(gb, io, 0, b)
                ro = ort.RunOptions()
                ro.add_run_config_entry("gpu_graph_id", str(b))
                host_in = ort.OrtValue.ortvalue_from_numpy(packed_host)
                host_out = ort.OrtValue.ortvalue_from_numpy(np.zeros((b, 1, vocab), dtype=np.float32))

                def replay(gb=gb, ro=ro):
                    gsession._sess.run_with_iobinding(gb._iobinding, ro)
                    gb.synchronize_outputs()

                def step(gb=gb, ro=ro, host_in=host_in, packed_dev=packed_dev, glogits=glogits, host_out=host_out):
                    ort.copy_tensors([host_in], [packed_dev])
                    gsession._sess.run_with_iobinding(gb._iobinding, ro)
                    ort.copy_tensors([glogits], [host_out])
                graphs[f"b{b}"] = {"replay": _median_ms(replay, args.repeat, warm=3),
                                   "upload_replay_readback": _median_ms(step, args.repeat)}
                print(json.dumps({f"graph_b{b}": graphs[f"b{b}"]}), flush=True)
        except Exception as exc:  # noqa: BLE001 - a probe: record why
            graphs["error"] = f"{type(exc).__name__}: {exc}"
            print(json.dumps({"graph_error": graphs["error"]}), flush=True)
        result["cuda_graphs_ms"] = graphs


if __name__ == "__main__":
    raise SystemExit(main())
