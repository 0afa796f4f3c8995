"""Decode tokens/s of our engine on the WebGPU EP (synthetic INT4, fp16) beside PyTorch bf16 and the bandwidth bound.

Engine-direct (AsyncEngine in-process, greedy, ignore_eos), batch 1 for three model shapes with and without
graph capture, and batch 64 on the 1B shape. Runs on the device machine; writes gpu_bench.json (after every
step, so a later failure keeps earlier figures) and gpu_bench.png to --out. Usage there:

    source .device/setup.sh; python3 -m perf.gpu.bench_gpu --out $OUT [--torch]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from perf.gpu.shapes import (
    HBM_BYTES_PER_S, OUTPUT_TOKENS, PROMPT_TOKENS, PROTOTYPE_TORCH_EAGER, PROTOTYPE_WEBGPU, SHAPES,
)

MAX_LENGTH = 512  # the models' context; batch-1 runs use all of it as KV length
BATCH = 64
BATCH_MAX_MODEL_LEN = 256  # KV length of the batch-64 runs (prompt + 128 outputs fit)


class Results:
    """The report, rewritten to disk after every change."""

    def __init__(self, out: Path) -> None:
        self.path = out / "gpu_bench.json"
        self.data: dict[str, Any] = {"schema": "ortserve-gpu-bench/1", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                     "settings": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                                                  "max_length": MAX_LENGTH, "batch": BATCH,
                                                  "batch_max_model_len": BATCH_MAX_MODEL_LEN,
                                                  "hbm_bytes_per_s": HBM_BYTES_PER_S},
                                     "machine": _machine(), "shapes": {}, "batch": {}}

    def put(self, keys: tuple[str, ...], value: Any) -> None:
        node = self.data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
        self.path.write_text(json.dumps(self.data, indent=2, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    return str(value)


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"], capture_output=True, text=True,
                                     timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = None
    try:
        import onnxruntime as ort
        info["onnxruntime"] = ort.__version__
    except ImportError:
        pass
    return info


def build_models(root: Path, names: list[str]) -> dict[str, Path]:
    """Synthetic INT4 (Q4_0 blocks, Q8_0 tied embedding/LM head), float16 activations and KV, per shape."""
    from engine.builder import SyntheticSpec, build_synthetic

    paths = {}
    for name in names:
        spec = SyntheticSpec(**SHAPES[name], max_length=MAX_LENGTH, quant="int4", dtype="float16", seed=0)
        t0 = time.perf_counter()
        paths[name] = build_synthetic(root / name, spec, accuracy_level=4)
        print(f"built {name} in {time.perf_counter() - t0:.1f}s", flush=True)
    return paths


def int4_bytes_per_token(model_dir: Path, context: int) -> dict[str, float]:
    """Bytes one decode step reads: every weight once (the tied table through the LM head; the embedding
    gather reads one row), the rotary caches aside, plus the KV of ``context`` positions."""
    import onnx

    proto = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    weights = 0
    for t in proto.graph.initializer:
        # NOTE(bench): the tied table is stored twice (gather and LM head); the gather reads one row.
        if t.name in ("cos_cache", "sin_cache") or t.name.startswith("embed."):
            continue
        length = next((int(e.value) for e in t.external_data if e.key == "length"), None)
        weights += length if length is not None else len(t.raw_data)
    genai = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    kv = 2 * genai["num_hidden_layers"] * genai["num_key_value_heads"] * genai["head_size"] * 2 * context
    return {"weights": float(weights), "kv": float(kv), "total": float(weights + kv)}


async def _stream(engine: Any, prompt: list[int], max_tokens: int, rid: str) -> list[tuple[float, int]]:
    """(perf_counter, cumulative generated tokens) at every output of one greedy request."""
    from engine.types import SamplingParams

    stamps = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(prompt, params, rid):
        stamps.append((time.perf_counter(), out.num_generated_tokens))
    return stamps


def _prompts(n: int, vocab: int) -> list[list[int]]:
    return [[1] + [(97 * i + 31 * j) % (vocab - 3) + 3 for j in range(PROMPT_TOKENS - 1)] for i in range(n)]


def run_engine(model_dir: Path, *, batch: int, graph_capture: bool | None, max_model_len: int,
               reps: int, provider: str = "webgpu") -> dict[str, Any]:
    """Engine-direct greedy decode: ``batch`` requests together, OUTPUT_TOKENS each, ``reps`` timed rounds."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    config = EngineConfig(provider=provider, max_batch=batch, max_queue=batch, max_model_len=max_model_len,
                          prefill_chunk=max(256, batch + 1), graph_capture=graph_capture, seed=0,
                          engine_process=False)  # the engine alone, as its earlier figures were measured
    t0 = time.perf_counter()
    engine = AsyncEngine.from_model_dir(model_dir, config)
    load_s = time.perf_counter() - t0
    result: dict[str, Any] = {"load_s": load_s, "placement": engine.placement, "rounds": []}
    try:
        prompts = _prompts(batch, engine.vocab_size)

        async def one_round(max_tokens: int) -> dict[str, Any]:
            start = time.perf_counter()
            streams = await asyncio.gather(*(_stream(engine, p, max_tokens, f"b{i}-{time.monotonic_ns()}")
                                             for i, p in enumerate(prompts)))
            end = time.perf_counter()
            return _round_figures(streams, start, end)

        asyncio.run(one_round(16))  # warm-up: kernels compiled, pools filled
        for _ in range(reps):
            result["rounds"].append(asyncio.run(one_round(OUTPUT_TOKENS)))
    finally:
        engine.shutdown()
    rates = [r["decode_tokens_per_s"] for r in result["rounds"]]
    result["decode_tokens_per_s"] = max(rates) if rates else None
    result["decode_tokens_per_s_all"] = rates
    return result


def _round_figures(streams: list[list[tuple[float, int]]], start: float, end: float) -> dict[str, Any]:
    """Aggregate and steady-state decode rates of one round.

    Batch 1: (tokens after the first) / (last output - first output). Several requests: the steady window
    runs from the last request's first token to the first request's end, where all of them decode.
    """
    total = sum(s[-1][1] for s in streams)
    figures: dict[str, Any] = {"num_requests": len(streams), "tokens": total, "wall_s": end - start,
                               "aggregate_tokens_per_s": total / (end - start),
                               "ttft_s_max": max(s[0][0] for s in streams) - start}
    if len(streams) == 1:
        (first_t, first_n), (last_t, last_n) = streams[0][0], streams[0][-1]
        figures["decode_tokens_per_s"] = (last_n - first_n) / (last_t - first_t)
        return figures
    lo = max(s[0][0] for s in streams)
    hi = min(s[-1][0] for s in streams)
    figures["steady_window_s"] = hi - lo
    if hi > lo:
        def count_at(stream: list[tuple[float, int]], t: float) -> int:
            return max((n for ts, n in stream if ts <= t), default=0)
        tokens = sum(count_at(s, hi) - count_at(s, lo) for s in streams)
        figures["decode_tokens_per_s"] = tokens / (hi - lo)
    else:
        figures["decode_tokens_per_s"] = total / (end - start)
    return figures


def run_torch(out: Path, names: list[str], timeout_s: float) -> dict[str, Any]:
    """The PyTorch reference in its own process (a hung compile must not take the engine figures with it)."""
    cmd = [sys.executable, "-m", "perf.gpu.torch_ref", "--out", str(out / "torch_ref.json"),
           "--shapes", ",".join(names), "--deadline-s", str(max(30.0, timeout_s - 20))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
    except subprocess.TimeoutExpired as exc:
        print(f"torch reference timed out after {timeout_s:.0f}s", flush=True)
        del exc
    path = out / "torch_ref.json"
    return json.loads(path.read_text()) if path.is_file() else {"error": "no torch_ref.json"}


def plot(data: dict[str, Any], path: Path) -> None:
    """Bars per shape: engine (capture / no capture), PyTorch (eager / compiled), bandwidth bounds as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in SHAPES if n in data["shapes"]]
    series = [("ortserve WebGPU + capture", ("engine", "capture")), ("ortserve WebGPU", ("engine", "no_capture")),
              ("PyTorch bf16 static+compile", ("torch", "static_compile")), ("PyTorch bf16 eager", ("torch", "eager"))]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(series)
    for k, (label, (group, key)) in enumerate(series):
        values = []
        for n in names:
            v = data["shapes"][n].get(group, {}).get(key, {})
            values.append(v.get("decode_tokens_per_s") or 0.0 if isinstance(v, dict) else 0.0)
        ax.bar([i + k * width for i in range(len(names))], values, width, label=label)
    for i, n in enumerate(names):
        bound = data["shapes"][n].get("bound", {}).get("int4_tokens_per_s")
        if bound:
            ax.hlines(bound, i - 0.1, i + 0.9, colors="k", linestyles="dashed")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s, batch 1 (log)")
    ax.set_title("H200: decode tokens/s (dashed: INT4 bandwidth bound)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", type=Path, default=Path("/tmp/ortserve_gpu_models"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--provider", default="webgpu", help="engine provider (cpu: a dry run of this script)")
    p.add_argument("--no-batch", dest="batch", action="store_false", help="skip the batch-64 runs")
    p.add_argument("--torch", action="store_true", help="also run the PyTorch reference (own process)")
    p.add_argument("--torch-timeout-s", type=float, default=300.0)
    p.add_argument("--deadline-s", type=float, default=540.0, help="skip steps that would start after this")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    names = [n for n in args.shapes.split(",") if n]
    res = Results(args.out)
    paths = build_models(args.models, names)
    for name in names:
        ctx = PROMPT_TOKENS + OUTPUT_TOKENS // 2
        nbytes = int4_bytes_per_token(paths[name], ctx)
        res.put(("shapes", name, "bound"), {"int4_bytes_per_token": nbytes, "context": ctx,
                                            "int4_tokens_per_s": HBM_BYTES_PER_S / nbytes["total"],
                                            "prototype_webgpu": PROTOTYPE_WEBGPU[name],
                                            "prototype_torch_eager": PROTOTYPE_TORCH_EAGER[name]})
    # Most important first: the 1B shape (the target), then the others, then batch 64.
    order = sorted(names, key=lambda n: n != "llama-3.2-1b")
    steps: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    for name in order:
        steps.append((("shapes", name, "engine", "capture"),
                      dict(model=name, batch=1, graph_capture=None, max_model_len=MAX_LENGTH)))
        steps.append((("shapes", name, "engine", "no_capture"),
                      dict(model=name, batch=1, graph_capture=False, max_model_len=MAX_LENGTH)))
        if name == "llama-3.2-1b" and args.batch:
            steps.append((("batch", name, "capture"),
                           dict(model=name, batch=BATCH, graph_capture=None, max_model_len=BATCH_MAX_MODEL_LEN)))
            steps.append((("batch", name, "no_capture"),
                           dict(model=name, batch=BATCH, graph_capture=False, max_model_len=BATCH_MAX_MODEL_LEN)))
    for keys, spec in steps:
        if time.perf_counter() - t_start > args.deadline_s:
            res.put(keys, {"skipped": "deadline"})
            continue
        print(f"== {'/'.join(keys)}", flush=True)
        try:
            figures = run_engine(paths[spec["model"]], batch=spec["batch"], graph_capture=spec["graph_capture"],
                                 max_model_len=spec["max_model_len"], reps=args.reps, provider=args.provider)
        except Exception as exc:  # noqa: BLE001 - recorded; the next step still runs
            figures = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        res.put(keys, figures)
        print(json.dumps({k: v for k, v in figures.items() if k != "rounds"}, default=_jsonable)[:600], flush=True)
    for name in names:
        b1 = res.data["shapes"][name]["engine"].get("capture", {}).get("decode_tokens_per_s")
        if b1:
            res.put(("shapes", name, "engine", "capture_vs_prototype"), b1 / PROTOTYPE_WEBGPU[name])
    b1 = res.data["shapes"].get("llama-3.2-1b", {}).get("engine", {})
    for key in ("capture", "no_capture"):
        agg = res.data["batch"].get("llama-3.2-1b", {}).get(key, {}).get("decode_tokens_per_s")
        single = b1.get(key, {}).get("decode_tokens_per_s")
        if agg and single:
            res.put(("batch", "llama-3.2-1b", f"{key}_vs_batch1"), agg / single)
    if args.torch:
        remaining = args.deadline_s - (time.perf_counter() - t_start)
        torch_data = run_torch(args.out, names, min(args.torch_timeout_s, max(60.0, remaining)))
        for name, figures in torch_data.get("shapes", {}).items():
            res.put(("shapes", name, "torch"), figures)
        res.put(("torch_meta",), {k: v for k, v in torch_data.items() if k != "shapes"})
    try:
        plot(res.data, args.out / "gpu_bench.png")
    except Exception as exc:  # noqa: BLE001 - the JSON is the result; the plot can be drawn elsewhere
        print(f"no plot: {exc}", flush=True)
    print(f"done in {time.perf_counter() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
