"""The decode ceiling: a bare ONNX Runtime loop on the same model folder beside the engine, at batch 1 and 8.

A bare loop is what no server can beat on this machine: the engine's session options and bindings, the KV
buffer shared by past and present, inputs written in place, a numpy argmax, and nothing else (no threads,
queues, detokenizing or HTTP). Running it beside the engine, interleaved round by round, says how much of
a figure is the engine's and how much ONNX Runtime's kernels leave for anyone: in particular the batch-8
over batch-1 ratio of the bare loop is the most any scheduler can get from continuous batching here.

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m perf.ceiling --rounds 5 --genai --json c.json --plot c.png

Engine figures are steady-state: at batch B, tokens produced while all B requests were decoding, over that
window (prefills excluded); at batch 1, tokens after the first over the time after it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


class BareLoop:
    """Greedy decode of B rows with one IOBinding per shape; the engine's session options."""

    def __init__(self, model_dir: Path, batch: int, threads: int, max_length: int,
                 profile_prefix: str | None = None, stop_spinning: bool | None = None,
                 allow_spinning: bool = True) -> None:
        """``profile_prefix``: turn on ONNX Runtime's profiler, its JSON written from that prefix (op_profile);
        ``stop_spinning``, ``allow_spinning``: ``EngineConfig``'s (two loops run in turn, as a target and its
        draft)."""
        import onnxruntime as ort

        from engine.config import EngineConfig
        from engine.model_loader import check_graph, read_model_folder, session_options

        self.ort = ort
        folder = read_model_folder(model_dir)
        options = session_options(EngineConfig(intra_op_threads=threads, stop_spinning=stop_spinning,
                                                allow_spinning=allow_spinning))
        if profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        self.session = ort.InferenceSession(str(folder.model_file), options, providers=["CPUExecutionProvider"])
        self.io = check_graph(folder, self.session)
        self.batch, self.length = batch, max_length
        shape = (batch, folder.num_kv_heads, max_length, folder.head_size)
        self.kv = [np.zeros(shape, self.io.kv_dtype) for _ in range(2 * folder.num_layers)]
        self.keep_last = "logits_to_keep" in {i.name for i in self.session.get_overridable_initializers()}

    def _bind_kv(self, binding: Any, lo: int, hi: int) -> None:
        names = zip(self.io.past_keys, self.io.past_values, self.io.present_keys, self.io.present_values)
        for i, (pk, pv, ok, ov) in enumerate(names):
            k = self.ort.OrtValue.ortvalue_from_numpy(self.kv[2 * i][lo:hi])
            v = self.ort.OrtValue.ortvalue_from_numpy(self.kv[2 * i + 1][lo:hi])
            binding.bind_ortvalue_input(pk, k)
            binding.bind_ortvalue_input(pv, v)
            binding.bind_ortvalue_output(ok, k)
            binding.bind_ortvalue_output(ov, v)

    def prompt_logits(self, prompt: list[int], row: int = 0, keep_all: bool = False) -> np.ndarray:
        """One run of ``prompt`` from position 0 in ``row``: the last position's logits ``[1, vocab]``, or every
        position's ``[n, vocab]`` (``keep_all``, or a graph that keeps them all)."""
        n = len(prompt)
        # NOTE(bench): IOBinding keeps no reference to the numpy arrays it binds: they must outlive the run.
        ids = np.array([prompt], np.int64)
        pos = np.arange(n, dtype=np.int64)[None]
        # The mask is as wide as the KV buffer, as the engine binds a prompt's.
        mask = np.zeros((1, self.length), np.int64)
        mask[0, :n] = 1
        kept = n if keep_all or not self.keep_last else 1
        keep = self.ort.OrtValue.ortvalue_from_numpy(np.array([kept], np.int64))
        b = self.session.io_binding()
        b.bind_cpu_input(self.io.input_ids, ids)
        if self.io.position_ids:
            b.bind_cpu_input(self.io.position_ids, pos)
        b.bind_cpu_input(self.io.attention_mask, mask)
        if self.keep_last:
            b.bind_ortvalue_input("logits_to_keep", keep)
        logits = np.zeros((1, kept, self.io.vocab_size), np.float32)
        b.bind_output(self.io.logits, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self._bind_kv(b, row, row + 1)
        self.session.run_with_iobinding(b)
        return logits[0]

    def prefill(self, prompt: list[int]) -> np.ndarray:
        """The prompt into every row (one B=1 run per row); returns each row's first token."""
        return np.array([int(np.argmax(self.prompt_logits(prompt, row)[-1])) for row in range(self.batch)], np.int64)

    def begin(self, first: np.ndarray, start: int) -> None:
        """Bind the decode inputs for greedy steps from position ``start``, feeding ``first`` (``[B]``) first."""
        B = self.batch
        self._ids = np.zeros((B, 1), np.int64)
        self._pos = np.zeros((B, 1), np.int64)
        # Every row sits at the same position, so a step's mask is all ones, as wide as the sequence (what
        # the engine binds on CPU): contiguous views of one buffer, no per-step allocation.
        self._ones = np.ones(B * self.length, np.int64)
        self._logits = np.zeros((B, 1, self.io.vocab_size), np.float32)
        self._binding = b = self.session.io_binding()
        b.bind_cpu_input(self.io.input_ids, self._ids)
        if self.io.position_ids:
            b.bind_cpu_input(self.io.position_ids, self._pos)
        b.bind_output(self.io.logits, "cpu", 0, np.float32, list(self._logits.shape), self._logits.ctypes.data)
        self._bind_kv(b, 0, B)
        self._ids[:, 0] = first
        self.position = start

    @property
    def last_logits(self) -> np.ndarray:
        """The logits the last ``step`` chose from, ``[B, vocab]`` (a view, overwritten by the next step)."""
        return self._logits[:, 0]

    def step(self) -> np.ndarray:
        """One greedy step of every row (after ``begin``); returns the tokens it produced, ``[B]``."""
        B, p = self.batch, self.position
        self._pos[:, 0] = p
        self._binding.bind_cpu_input(self.io.attention_mask, self._ones[:B * (p + 1)].reshape(B, p + 1))
        self.session.run_with_iobinding(self._binding)
        self._ids[:, 0] = np.argmax(self._logits[:, 0], axis=-1)
        self.position = p + 1
        return self._ids[:, 0]

    def decode(self, first: np.ndarray, start: int, steps: int) -> float:
        """``steps`` batched greedy steps from position ``start``; returns decode tokens/s (all rows).

        The tokens generated (``[B, steps]``, the first not included) are left in ``self.tokens``.
        """
        self.begin(first, start)
        self.tokens = np.zeros((self.batch, steps), np.int64)
        t0 = time.perf_counter()
        for i in range(steps):
            self.tokens[:, i] = self.step()
        return self.batch * steps / (time.perf_counter() - t0)


def genai_decode(model: Any, og: Any, prompt: list[int], steps: int) -> float:
    """onnxruntime-genai's own loop (C++) on the same folder, batch 1: decode tokens/s after the first."""
    params = og.GeneratorParams(model)
    length = len(prompt) + steps
    params.set_search_options(max_length=length, min_length=length, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    generator.generate_next_token()
    t0 = time.perf_counter()
    n = 0
    while not generator.is_done():
        generator.generate_next_token()
        generator.get_next_tokens()
        n += 1
    return n / (time.perf_counter() - t0)


async def engine_decode(engine: Any, prompt: list[int], batch: int, steps: int) -> float:
    """Steady-state decode tokens/s of ``batch`` concurrent greedy requests through the engine."""
    from engine.types import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    stamps: list[list[float]] = [[] for _ in range(batch)]

    async def one(i: int) -> None:
        async for out in engine.generate(prompt, params, f"ceiling-{batch}-{i}-{time.monotonic_ns()}"):
            stamps[i].extend([time.perf_counter()] * len(out.token_ids))

    await asyncio.gather(*(one(i) for i in range(batch)))
    lo = max(s[0] for s in stamps)  # every request has its first token: all are decoding
    hi = min(s[-1] for s in stamps)  # until the first one ends
    if batch == 1:
        return (len(stamps[0]) - 1) / (stamps[0][-1] - stamps[0][0])
    tokens = sum(sum(1 for t in s if lo < t <= hi) for s in stamps)
    if hi <= lo or tokens == 0:
        raise ValueError(f"the {batch} requests never decoded together (a request ended before the last one "
                         f"started): ask for more output tokens")
    return tokens / (hi - lo)


def plot_ceiling(data: dict, path: str | Path) -> Path:
    """The ceiling's figures: decode tokens/s of the bare loop, the engine (and onnxruntime-genai) per batch,
    each round a dot, the median a bar."""
    from matplotlib.figure import Figure

    from bench.plots import save_figure

    runs, med = data["runs"], data["median"]
    batches = sorted({int(k.rsplit("_b", 1)[1]) for k in med})
    kinds = [("bare", "bare ONNX Runtime loop"), ("engine", "ortserve engine"), ("genai", "onnxruntime-genai")]
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    width = 0.27
    for j, (kind, label) in enumerate(kinds):
        xs = [i + (j - 1) * width for i, b in enumerate(batches) if f"{kind}_b{b}" in med]
        keys = [f"{kind}_b{b}" for b in batches if f"{kind}_b{b}" in med]
        if not keys:
            continue
        ax.bar(xs, [med[k] for k in keys], width, label=label)
        for x, k in zip(xs, keys):
            ax.plot([x] * len(runs), [r[k] for r in runs], "k.", ms=3)
            ax.annotate(f"{med[k]:.0f}", (x, med[k]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s (all rows)")
    s = data.get("settings", {})
    ax.set_title(f"decode ceiling - {s.get('threads', '?')} threads, prompt {s.get('prompt_tokens', '?')}, "
                 f"{s.get('output_tokens', '?')} out, {len(runs)} rounds (dots)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder, .gguf or known name (default: the default model, pulled if needed)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--genai", action="store_true", help="also onnxruntime-genai's loop at batch 1")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="a PNG of the figures (plot_ceiling)")
    args = ap.parse_args(argv)
    from engine.async_engine import AsyncEngine
    from engine.builder.pull import DEFAULT_MODEL, resolve_model
    from engine.config import EngineConfig

    model = resolve_model(args.model or DEFAULT_MODEL)
    batches = [int(b) for b in args.batch.split(",")]
    prompt = [(17 * i + 100) % 40000 + 100 for i in range(args.prompt_tokens)]
    engine = AsyncEngine.from_model_dir(model, EngineConfig(intra_op_threads=args.threads, max_batch=max(batches)))
    bare = {b: BareLoop(model, b, args.threads, engine.max_model_len) for b in batches}
    genai = None
    if args.genai:
        import onnxruntime_genai as og

        config = og.Config(str(model))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": args.threads, "inter_op_num_threads": 1}}}}))
        genai = (og.Model(config), og)
    runs: list[dict[str, float]] = []
    try:
        for rnd in range(args.rounds):
            row: dict[str, float] = {}
            for b in batches:
                first = bare[b].prefill(prompt)
                row[f"bare_b{b}"] = bare[b].decode(first, len(prompt), args.output_tokens)
                time.sleep(0.3)
                row[f"engine_b{b}"] = asyncio.run(engine_decode(engine, prompt, b, args.output_tokens))
                time.sleep(0.3)
            if genai is not None:
                row["genai_b1"] = genai_decode(*genai, prompt, args.output_tokens)
                time.sleep(0.3)
            runs.append(row)
            print(f"round {rnd + 1}: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    finally:
        engine.shutdown()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"\ndecode tokens/s, median of {args.rounds} rounds ({args.threads} threads, prompt "
          f"{args.prompt_tokens}, {args.output_tokens} out):")
    print(f"{'batch':>6} {'bare loop':>10} {'engine':>8} {'engine/bare':>12}")
    for b in batches:
        print(f"{b:>6} {med[f'bare_b{b}']:>10.1f} {med[f'engine_b{b}']:>8.1f} "
              f"{statistics.median(r[f'engine_b{b}'] / r[f'bare_b{b}'] for r in runs):>12.3f}")
    if genai is not None:
        print(f"onnxruntime-genai, batch 1: {med['genai_b1']:.1f}; engine/genai "
              f"{statistics.median(r['engine_b1'] / r['genai_b1'] for r in runs):.3f}, bare/genai "
              f"{statistics.median(r['bare_b1'] / r['genai_b1'] for r in runs):.3f}")
    scaling = {}
    if 1 in batches:
        for b in batches:
            if b > 1:
                scaling[b] = {kind: statistics.median(r[f"{kind}_b{b}"] / r[f"{kind}_b1"] for r in runs)
                              for kind in ("bare", "engine")}
                print(f"batch {b} / batch 1: bare loop {scaling[b]['bare']:.2f}x, engine {scaling[b]['engine']:.2f}x")
    data = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {
        "model": str(model)}, "runs": runs, "median": med, "scaling": {str(k): v for k, v in scaling.items()}}
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    if args.plot:
        print(f"plot: {plot_ceiling(data, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
