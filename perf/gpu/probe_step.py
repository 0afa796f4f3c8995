"""Where a WebGPU decode step's time goes, and which graph variants compute the CPU EP's logits.

A diagnostic for the device machine (no engine threads: the Runner alone). Writes probe.json to --out.
    python3 -m perf.gpu.probe_step --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.config import EngineConfig
from engine.graph_capture import PACKED_INPUT, TOTAL_LEN_NAME, capture_graph_bytes
from engine.kv_cache import KVCache, KVShape, make_kv_allocator
from engine.model_loader import ModelFolder, check_graph, create_session, read_model_folder
from engine.bucket_runner import BucketRunner, DecodePath
from engine.runner import make_input_allocator


def partial_graph(folder: ModelFolder, kv_length: int, *, freeze: bool, const_total: bool) -> bytes:
    """capture_graph_bytes with only some of its rewrites (to find which one a device needs)."""
    import onnx
    from onnx import numpy_helper

    if freeze and const_total:
        return capture_graph_bytes(folder, kv_length)
    proto = onnx.load(str(folder.model_file), load_external_data=False)
    g = proto.graph
    if freeze:
        inits = {t.name for t in g.initializer}
        kept = [i for i in g.input if i.name not in inits]
        del g.input[:]
        g.input.extend(kept)
    if const_total:
        for node in g.node:
            if node.op_type == "GroupQueryAttention":
                node.input[6] = TOTAL_LEN_NAME
        g.initializer.append(numpy_helper.from_array(np.array(kv_length, np.int32), TOTAL_LEN_NAME))
    return proto.SerializeToString()


def make_runner(folder: ModelFolder, config: EngineConfig, *, kv_length: int, model_bytes: bytes | None,
                capture: bool, packed: bool = False) -> BucketRunner:
    if config.provider == "cpu":
        session, selected = create_session(folder, config, model_bytes=model_bytes)
    else:
        from ep import device

        selected = device.select_device(config.provider)
        session, _ = create_session(folder, config, selected=selected, graph_capture=capture,
                                    model_bytes=model_bytes)
    io = check_graph(folder, session, packed_input=PACKED_INPUT if packed else None)
    kv = KVCache(KVShape(folder.num_layers, config.max_batch, folder.num_kv_heads, kv_length, folder.head_size,
                         io.kv_dtype), make_kv_allocator(selected, session))
    device_alloc = None
    if capture:
        from ep import host_memory

        def device_alloc(shape, dtype):
            if selected is None:  # a CPU dry run of this script
                return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype))
            return host_memory.alloc_device(shape, dtype, selected, session=session, zero=True)
    return BucketRunner(session, io, kv, prefill_chunk=64, max_position=kv_length,
                        input_allocator=make_input_allocator(selected),
                        decode=DecodePath(buckets=False, device_alloc=device_alloc,
                                          packed_input=PACKED_INPUT if packed else None))


def teacher_forced(runner: BucketRunner, steps: int = 8) -> np.ndarray:
    """Logits [steps + 1, slots_used, V]: a 5-token prompt in slot 0 and 3 in slot 2, then fixed tokens."""
    out = [np.stack([runner.prefill(0, [1, 17, 942, 301, 55], 0), runner.prefill(2, [1, 400, 12], 0)])]
    for i in range(steps):
        out.append(runner.decode([0, 2], [(37 * i + 5) % 1000, (11 * i + 7) % 1000], [5 + i, 3 + i]).copy())
    return np.stack(out)


def correctness(model: Path) -> dict[str, Any]:
    folder = read_model_folder(model)
    kv_length = 256
    base = EngineConfig(max_batch=4, prefill_chunk=64)
    ref = teacher_forced(make_runner(folder, base, kv_length=kv_length, model_bytes=None, capture=False))
    gpu = replace(base, provider="webgpu")
    variants = {
        "orig_nocap": dict(model_bytes=None, capture=False),
        "frozen_keep_nocap": dict(model_bytes=partial_graph(folder, kv_length, freeze=True, const_total=False),
                                  capture=False),
        "const_total_nocap": dict(model_bytes=partial_graph(folder, kv_length, freeze=False, const_total=True),
                                  capture=False),
        "rewritten_nocap": dict(model_bytes=capture_graph_bytes(folder, kv_length), capture=False),
        "rewritten_capture": dict(model_bytes=capture_graph_bytes(folder, kv_length), capture=True),
    }
    results = {}
    for name, kw in variants.items():
        try:
            got = teacher_forced(make_runner(folder, gpu, kv_length=kv_length, **kw))
            results[name] = {"max_abs_diff": float(np.max(np.abs(got - ref))),
                             "argmax_agree": float(np.mean(got.argmax(-1) == ref.argmax(-1))),
                             "first_step_max_abs_diff": float(np.max(np.abs(got[0] - ref[0])))}
        except Exception as exc:  # noqa: BLE001
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
        print("correctness", name, results[name], flush=True)
    return results


def decode_ready_runner(model: Path, ep_options: dict[str, str], capture: bool, *, packed: bool, batch: int,
                        kv_length: int, provider: str = "webgpu") -> tuple[BucketRunner, ort.IOBinding]:
    """A whole-buffer Runner on the rewritten graph, warmed up, every slot holding a 4-token prompt; and its
    whole-batch decode binding. ``provider="cpu"`` is a dry run of the scripts on this machine."""
    folder = read_model_folder(model)
    config = EngineConfig(provider=provider, max_batch=batch, prefill_chunk=max(64, batch + 1),
                          ep_options=ep_options)
    runner = make_runner(folder, config, kv_length=kv_length, packed=packed, capture=capture,
                         model_bytes=capture_graph_bytes(folder, kv_length, packed=packed))
    runner.warmup()
    for slot in range(batch):
        runner.prefill(slot, [1, 2, 3, 4], 0)
    return runner, runner._decode_bindings[(0, batch)]


def step_timing(model: Path, ep_options: dict[str, str], capture: bool, steps: int = 100, *,
                packed: bool = False, batch: int = 1, kv_length: int = 512) -> dict[str, Any]:
    """Per-step upload/run/readback(/argmax) times, and replays back to back (the GPU-bound floor)."""
    runner, binding = decode_ready_runner(model, ep_options, capture, packed=packed, batch=batch,
                                          kv_length=kv_length)
    rows = np.arange(batch)
    t_up, t_run, t_read, t_argmax = [], [], [], []
    for i in range(steps):
        runner.decode_ids[:, 0] = 5 + i
        runner.decode_pos[:, 0] = 4 + i
        runner._set_ones(rows, np.full(batch, 5 + i))
        t0 = time.perf_counter()
        if runner.device_io is not None:
            if runner._packed is not None:
                runner._packed[:, 0] = runner.decode_ids[:, 0]
                runner._packed[:, 1] = runner.mask_ones - 1
            runner.device_io.upload()
        t1 = time.perf_counter()
        runner.session.run_with_iobinding(binding)
        t2 = time.perf_counter()
        logits = runner.device_io.read_logits() if runner.device_io is not None else runner.decode_logits
        t3 = time.perf_counter()
        np.argmax(logits[:, 0], axis=-1)
        t4 = time.perf_counter()
        t_up.append(t1 - t0)
        t_run.append(t2 - t1)
        t_read.append(t3 - t2)
        t_argmax.append(t4 - t3)
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        runner.session.run_with_iobinding(binding)
    if runner.device_io is not None:
        runner.device_io.read_logits()
    back_to_back_ms = (time.perf_counter() - t0) * 1000 / n
    ms = lambda xs: float(np.median(xs) * 1000)  # noqa: E731
    return {"upload_ms": ms(t_up), "run_ms": ms(t_run), "read_ms": ms(t_read), "argmax_ms": ms(t_argmax),
            "step_ms": ms(np.array(t_up) + np.array(t_run) + np.array(t_read) + np.array(t_argmax)),
            "back_to_back_run_ms": back_to_back_ms, "ep_options": ep_options, "capture": capture,
            "packed": packed, "batch": batch}


def kernel_profile(model: Path, ep_options: dict[str, str]) -> dict[str, Any]:
    """ORT's profile of a few uncaptured decode runs: kernel events per run, time by op type."""
    folder = read_model_folder(model)
    from ep import device, providers

    selected = device.select_device("webgpu")
    so = providers.make_session_options(selected, folder.genai, ep_options=ep_options)
    so.enable_profiling = True
    so.profile_file_prefix = "/tmp/ortserve_probe_profile"
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder.path))
    session = providers.create_session(capture_graph_bytes(folder, 512), selected, so)
    io = check_graph(folder, session)
    feeds = {io.input_ids: np.array([[5]], np.int64), io.attention_mask: np.ones((1, 512), np.int64)}
    if io.position_ids:
        feeds[io.position_ids] = np.array([[511]], np.int64)
    shape = (1, folder.num_kv_heads, 512, folder.head_size)
    for name in (*io.past_keys, *io.past_values):
        feeds[name] = np.zeros(shape, io.kv_dtype)
    runs = 5
    for _ in range(runs):
        session.run([io.logits], feeds)
    path = session.end_profiling()
    events = json.loads(Path(path).read_text())
    kernels = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    by_op: dict[str, list[float]] = {}
    for e in kernels:
        by_op.setdefault(e.get("args", {}).get("op_name", "?"), []).append(float(e.get("dur", 0)))
    Path(path).unlink(missing_ok=True)
    return {"kernel_events_per_run": len(kernels) / runs,
            "by_op": {op: {"count_per_run": len(v) / runs, "us_per_run": sum(v) / runs}
                      for op, v in sorted(by_op.items(), key=lambda kv: -sum(kv[1]))}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", type=Path, default=Path("/tmp/ortserve_gpu_models"))
    p.add_argument("--only-steps", action="store_true",
                   help="just the 1B step breakdown: batch 1 and 64, packed and three inputs (engine defaults)")
    args = p.parse_args(argv)
    from engine.builder import SyntheticSpec, build_synthetic

    from perf.gpu.shapes import SHAPES

    data: dict[str, Any] = {"onnxruntime": ort.__version__}
    out = args.out / "probe.json"

    def save() -> None:
        out.write_text(json.dumps(data, indent=2))

    if args.only_steps:
        path = args.models / "llama-3.2-1b"
        if not (path / "model.onnx").is_file():
            build_synthetic(path, SyntheticSpec(**SHAPES["llama-3.2-1b"], max_length=512, quant="int4",
                                                dtype="float16"), accuracy_level=4)
        for label, kw in (("b1_packed", dict(packed=True)), ("b1_three", dict(packed=False)),
                          ("b64_packed", dict(packed=True, batch=64, kv_length=256, steps=40))):
            try:
                data.setdefault("steps", {})[label] = step_timing(path, {}, True, **kw)
            except Exception as exc:  # noqa: BLE001
                data.setdefault("steps", {})[label] = {"error": f"{type(exc).__name__}: {exc}",
                                                       "trace": traceback.format_exc()[-1500:]}
                if kw.get("packed") and "batch" in kw:  # the batch figure matters more than its packing
                    data["steps"][label + "_three"] = step_timing(path, {}, True, **{**kw, "packed": False})
            print(label, data["steps"][label], flush=True)
            save()
        return 0
    test_model = build_synthetic(args.models / "test256", SyntheticSpec(
        hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=1024,
        max_length=256, quant="int4", dtype="float16", seed=3, tie_word_embeddings=False))
    data["correctness"] = correctness(test_model)
    save()
    for name in ("llama-3.2-1b", "smollm2-135m"):
        path = args.models / name
        if not (path / "model.onnx").is_file():
            build_synthetic(path, SyntheticSpec(**SHAPES[name], max_length=512, quant="int4", dtype="float16"),
                            accuracy_level=4)
        variants = [("capture", {}, True), ("capture_novalidation", {"validationMode": "disabled"}, True),
                    ("nocapture", {}, False), ("nocapture_novalidation", {"validationMode": "disabled"}, False),
                    ("nocapture_pending1024", {"maxNumPendingDispatches": "1024"}, False)]
        for label, opts, capture in variants:
            try:
                data.setdefault("timing", {}).setdefault(name, {})[label] = step_timing(path, opts, capture)
            except Exception as exc:  # noqa: BLE001
                data.setdefault("timing", {}).setdefault(name, {})[label] = {"error": f"{type(exc).__name__}: {exc}"}
            print(name, label, data["timing"][name][label], flush=True)
            save()
        try:
            data.setdefault("profile", {})[name] = kernel_profile(path, {})
        except Exception as exc:  # noqa: BLE001
            data.setdefault("profile", {})[name] = {"error": f"{type(exc).__name__}: {exc}",
                                                    "trace": traceback.format_exc()[-1500:]}
        print(name, "profile", json.dumps(data["profile"][name])[:1500], flush=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
