"""What each piece of the whole-buffer runner costs on the device (issue 13): a decode step per batch bucket, a
staged prefill run per chunk length, a device row copy, and a captured step's replay alone.

Drives the runner of a loaded engine directly (its core thread idle), median of several runs each:
    python -m perf.gpu.probe_buckets --model DIR --provider webgpu --max-batch 8 --out probe.json
``--gil-load`` times the batched prompts and the decode steps again while another Python thread keeps the
interpreter busy, as a server's event loop does beside the engine thread (each time the runner gives the interpreter
up, for a run, it may wait up to the switch interval to get it back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from ep import flags


def _median_ms(fn, repeat: int) -> float:
    fn()  # the first run of a shape may compile kernels: not counted
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def _once_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--provider", default="webgpu")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--whole-buffer", action="store_true", help="force the whole-buffer runner (a dry run on cpu)")
    ap.add_argument("--row-groups", type=int, default=None, help="EngineConfig.matmul_row_groups (0: off)")
    ap.add_argument("--cuda-int4-gemm", choices=("auto", "on", "off"), default="auto",
                    help="ORT_FPA_INTB_GEMM as the server sets it (ep.flags.apply_cuda_int4_gemm)")
    ap.add_argument("--fixed-chunk-shapes", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.fixed_chunk_shapes (chunks as pieces of warmed lengths)")
    ap.add_argument("--gil-load", action="store_true", help="time prompts and decode steps with a busy Python thread too")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    flags.apply_cuda_int4_gemm(args.provider, args.max_batch,
                               {"auto": None, "on": True, "off": False}[args.cuda_int4_gemm])
    t0 = time.perf_counter()
    engine = AsyncEngine.from_model_dir(args.model, EngineConfig(provider=args.provider, max_batch=args.max_batch,
                                                                 prefill_chunk=args.prefill_chunk,
                                                                 kv_rows="opaque" if args.whole_buffer else None,
                                                                 matmul_row_groups=args.row_groups,
                                                                 fixed_chunk_shapes={"auto": None, "on": True, "off": False}[
                                                                     args.fixed_chunk_shapes],
                                                                 engine_process=False))  # probes the runner
    result: dict = {"load_s": round(time.perf_counter() - t0, 2), "placement": str(engine.placement),
                    "max_batch": args.max_batch, "row_groups": args.row_groups}
    try:
        runner = engine._core.runner  # the core thread waits on its inbox: nothing else touches the runner
        result["buckets"] = list(runner.buckets)
        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(3, engine.vocab_size, 1024)]
        first_compile = time.perf_counter()
        runner.prefill(0, prompt[:50], 0)
        result["first_prefill_s50_ms"] = round((time.perf_counter() - first_compile) * 1e3, 1)
        result["prefill_ms"] = {}
        for s in (16, 50, 51, 64, 128, 256):
            if s <= args.prefill_chunk:
                result["prefill_ms"][s] = _median_ms(lambda s=s: runner.prefill(1, prompt[:s], 0), args.repeat)
        # a chunk length seen for the first time (a prompt's last chunk): its first run, then its second
        result["unseen_chunk_first_ms"], result["unseen_chunk_second_ms"] = {}, {}
        for s in (37, 93, 141, 199, 233):
            if s <= args.prefill_chunk:
                for key in ("unseen_chunk_first_ms", "unseen_chunk_second_ms"):
                    t = time.perf_counter()
                    runner.prefill(2, prompt[300:300 + s], 300)
                    result[key][s] = round((time.perf_counter() - t) * 1e3, 2)
        # a length seen before at a total length not seen before (does the device compile per mask width too?)
        result["seen_chunk_new_total_ms"] = {start: round(_once_ms(lambda start=start: runner.prefill(
            2, prompt[start:start + 64], start)), 2) for start in (400, 464, 600) if start + 64 <= len(prompt)}
        if getattr(runner, "copier", None) is not None and getattr(runner, "staging", None) is not None:
            result["staged_run_only_ms"] = {s: _median_ms(lambda s=s: runner._run_staged(prompt[:s], 0), args.repeat)
                                            for s in (50, 256) if s <= args.prefill_chunk}
            stage = runner._stage_buffers
            result["row_copy_ms"] = {
                "staging_to_slot": _median_ms(lambda: runner.copier.copy(stage, 0, runner._kv_buffers, 1), args.repeat),
                "slot_to_staging": _median_ms(lambda: runner.copier.copy(runner._kv_buffers, 1, stage, 0), args.repeat),
                "slot_to_slot": _median_ms(lambda: runner.copier.copy(runner._kv_buffers, 1, runner._kv_buffers, 2),
                                           args.repeat)}
        def steps(tag: str) -> None:
            result[f"decode_step_ms{tag}"], result[f"decode_step_summary_only_ms{tag}"] = {}, {}
            for b in runner.buckets:
                slots = list(range(b))
                for key, want in (("decode_step_ms", True), ("decode_step_summary_only_ms", False)):
                    if want or runner.decode_summary is not None:
                        result[key + tag][b] = _median_ms(lambda slots=slots, want=want: runner.decode(
                            slots, [5] * len(slots), [60] * len(slots), logits=want), args.repeat * 2)
            if runner.can_batch_prompts:  # new requests' prompts in one run (k rows of S tokens, slots 8...)
                result[f"prompts_ms{tag}"] = {
                    f"k{k}_s{s}": _median_ms(lambda k=k, s=s: runner.prefill_prompts(
                        list(range(8, 8 + k)), [prompt[:s]] * k), args.repeat)
                    for k in (1, 2, 4) for s in (51, 200) if 8 + k <= args.max_batch}
        steps("")
        if args.gil_load:
            sys.setswitchinterval(0.0005)  # the server's on a device (--gil-switch-interval-ms)
            stop = threading.Event()

            def busy() -> None:  # pure Python: holds the interpreter but at each switch interval
                n = 0
                while not stop.is_set():
                    n += 1
            loader = threading.Thread(target=busy, daemon=True)
            loader.start()
            try:
                steps("_gil_loaded")
            finally:
                stop.set()
                loader.join()
    finally:
        engine.shutdown()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
