"""The sampled path's cost per row: ``engine.sampler.sample_batch`` on real logits at batch 8, beside the
reference law computed the way the sampler did before issue 25 (the ``apply_*`` transforms and a float64
cumsum over the whole vocabulary per row) and, with ``--before``, another checkout's or git revision's
``sample_batch`` (e.g. main's, or the commit before a change), all interleaved in the same rounds.

Logits come from the model folders given (a real prompt, then tokens sampled at temperature 1: the rows a
served request sees; a base model without a chat template gets the prompt as plain text); a folder's
vocabulary sets the width (SmolLM2: 49,152; Gemma 3: 262,144). ``--synthetic`` adds rows of a given width
shaped like a model's for a vocabulary without a folder at hand.

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m perf.sampler --model-dir .cache/smollm2-135m-instruct \
        --model-dir .cache/gemma3-270m --synthetic 262144 --before aa03f97 \
        --json docs/perf/sampler.json --plot docs/perf/sampler.png

Targets (issue 25): <= 0.3 ms a row at 49k and <= 1 ms at 262k, batch 8.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from types import ModuleType
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "List five ideas for a weekend trip near the mountains and say why each is fun.",
    "What are the main differences between Python lists and tuples?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a recipe for a simple vegetable soup.",
    "Summarize the plot of a detective novel you would like to read.",
    "How do I ask my manager for a day off politely?",
)
# (name, SamplingParams fields): what clients send; the first is the openai SDK's default
CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("temperature 1", {}),
    ("temperature 0.7", {"temperature": 0.7}),
    ("top_p 0.95", {"top_p": 0.95}),
    ("top_k 40", {"top_k": 40}),
    ("min_p 0.05", {"min_p": 0.05}),
    ("0.8 / top_k 40 / top_p 0.95", {"temperature": 0.8, "top_k": 40, "top_p": 0.95}),
    ("presence 0.5 + top_p 0.9", {"presence_penalty": 0.5, "top_p": 0.9}),
    # rows that reach below -87 nats, where float32 exp turns subnormal (see engine.sampling_fast._SUBNORMAL)
    ("temperature 0.3", {"temperature": 0.3}),
    ("logit_bias -100 x 10", {"logit_bias": tuple((100 + i, -100.0) for i in range(10))}),
)


def collect_logits(model_dir: Path, rows: int, threads: int, seed: int = 0) -> np.ndarray:
    """float32 ``[rows, vocab]``: the logits after each prompt of PROMPTS and after the tokens a temperature-1
    draw then appends (``rows // len(PROMPTS)`` per prompt), from the engine's own runner."""
    from engine.config import EngineConfig
    from engine.kv_cache import HostKVAllocator, KVCache, KVShape
    from engine.model_loader import check_graph, create_session, read_model_folder
    from engine.runner import Runner
    from engine.sampler import RequestSampler
    from engine.types import SamplingParams

    folder = read_model_folder(model_dir)
    config = EngineConfig(max_batch=1, prefill_chunk=256, intra_op_threads=threads)
    session, _ = create_session(folder, config)
    io = check_graph(folder, session)
    length = 512
    kv = KVCache(KVShape(folder.num_layers, 1, folder.num_kv_heads, length, folder.head_size, io.kv_dtype),
                 HostKVAllocator())
    runner = Runner(session, io, kv, prefill_chunk=256, max_position=length)
    per_prompt = max(1, rows // len(PROMPTS))
    out = []
    for i, text in enumerate(PROMPTS):
        if folder.chat_template.available:
            ids = folder.tokenizer.encode(folder.chat_template.render([{"role": "user", "content": text}]))
        else:  # a base model (gemma3-270m): the text as a completions prompt, BOS and all
            ids = folder.tokenizer.encode(text, add_special_tokens=True)
        sampler = RequestSampler(SamplingParams(seed=seed + i), ids, io.vocab_size)
        logits = runner.prefill(0, ids, 0)
        pos = len(ids)
        for _ in range(per_prompt):
            out.append(np.array(logits, dtype=np.float32))
            token = sampler.sample(logits).token_id
            logits = runner.decode([0], [token], [pos])[0]
            pos += 1
        runner.release(0)
    return np.stack(out[:rows])


def synthetic_logits(vocab: int, rows: int, seed: int = 0) -> np.ndarray:
    """float32 ``[rows, vocab]`` shaped like a language model's: a Gumbel tail and 30 tokens 4-12 nats up."""
    rng = np.random.default_rng(seed)
    logits = (rng.gumbel(size=(rows, vocab)) * 1.5).astype(np.float32)
    strong = rng.integers(0, vocab, (rows, 30))
    logits[np.arange(rows)[:, None], strong] += rng.uniform(4, 12, (rows, 30)).astype(np.float32)
    return logits


def reference_draw(logits: np.ndarray, sampler: Any) -> int:
    """The pre-issue-25 route to the same law: every transform over the whole row, a float64 cumsum."""
    processed = sampler.process(logits)
    shifted = np.exp(processed.astype(np.float64) - processed.max())
    cdf = np.cumsum(shifted)
    return int(np.searchsorted(cdf, sampler.rng.random() * cdf[-1], side="right"))


# The sampler and the modules it imports, in import order: engine.sampling before the reference law and the fast path
# got their own names (engine.sampling_law, engine.sampling_fast); a checkout has one layout or the other.
SAMPLER_MODULES = ("engine.sampling", "engine.sampling_law", "engine.sampling_fast", "engine.sampler")


def load_sampler(root: Path) -> ModuleType:
    """``engine.sampler`` of another checkout (its sampling modules with it), loaded beside this tree's.

    NOTE(bench): the modules are executed under their own names while the other checkout's files stand in
    ``sys.modules``, then this tree's are put back: the other sampler keeps its own ``draw_tokens``. Both
    share this tree's ``engine.types``.
    """
    import engine.sampler  # noqa: F401 - this tree's, to put back afterwards

    saved = {name: sys.modules.get(name) for name in SAMPLER_MODULES}
    try:
        for name in SAMPLER_MODULES:
            path = root / (name.replace(".", "/") + ".py")
            if not path.is_file():  # a module of another layout (engine.sampling before the law/fast split)
                continue
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return module
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def git_sha(root: Path, rev: str = "HEAD") -> str:
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def checkout_of(before: str, tmp: Path) -> tuple[Path, str]:
    """``--before``'s tree and git SHA: a directory as it is, or a revision of this repository, whose
    sampler modules are written out under ``tmp`` (no checkout, no worktree)."""
    if Path(before).is_dir():
        return Path(before), git_sha(Path(before))
    root = Path(__file__).resolve().parents[1]
    for name in (m.replace(".", "/") + ".py" for m in SAMPLER_MODULES):
        out = subprocess.run(["git", "-C", str(root), "show", f"{before}:{name}"], capture_output=True, text=True)
        if out.returncode != 0:  # not in that revision's layout
            continue
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(out.stdout)
    return tmp, git_sha(root, before)


def time_per_row(fn: Callable[[], object], batch: int, min_s: float) -> tuple[float, float]:
    """(wall, CPU) milliseconds per row of one call of ``fn`` (which samples ``batch`` rows), medians of repeats.

    NOTE(bench): CPU time (the process's, BLAS threads included) is what a call costs; wall time adds the
    waits for a core on a shared machine. Both are reported; the targets are read on CPU time.
    """
    fn()
    wall, cpu = [], []
    t_end = time.perf_counter() + min_s
    while time.perf_counter() < t_end or len(wall) < 5:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(10):
            fn()
        wall.append((time.perf_counter() - t0) / 10)
        cpu.append((time.process_time() - c0) / 10)
    return statistics.median(wall) / batch * 1e3, statistics.median(cpu) / batch * 1e3


def measure(logits: np.ndarray, batch: int, rounds: int, min_s: float, before: ModuleType | None = None,
            cases: Sequence[tuple[str, dict[str, Any]]] = CASES) -> list[dict[str, Any]]:
    """Every case of CASES, ``rounds`` rounds (each its own ``batch`` rows), the routes interleaved in each round
    with their order rotating: this tree's ``sample_batch``, ``before``'s (another checkout's sampler module)
    and the reference route."""
    from engine import sampler as after
    from engine.types import SamplingParams

    vocab = logits.shape[1]
    rng = np.random.default_rng(0)
    results = []
    for name, fields in cases:
        params = SamplingParams(**fields)
        times: dict[str, list[tuple[float, float]]] = {"after": [], "before": [], "reference": []}
        for rnd in range(rounds):
            rows = logits[rng.choice(len(logits), batch, replace=False)]  # [batch, vocab]
            routes: list[tuple[str, Callable[[], object]]] = []
            for label, module in (("after", after), ("before", before)):
                if module is not None:
                    # each route its own samplers: the penalties see the tokens that route drew
                    samplers = [module.RequestSampler(params, list(range(64)), vocab) for _ in range(batch)]
                    routes.append((label, lambda m=module, s=samplers: m.sample_batch(rows, s)))
            ref_samplers = [after.RequestSampler(params, list(range(64)), vocab) for _ in range(batch)]
            routes.append(("reference", lambda: [reference_draw(r, s) for r, s in zip(rows, ref_samplers)]))
            shift = rnd % len(routes)
            for label, fn in routes[shift:] + routes[:shift]:  # interleaved, order rotating
                times[label].append(time_per_row(fn, batch, min_s))
        cpu = [c for _, c in times["after"]]
        result = {"case": name, "params": fields, "vocab": vocab, "batch": batch,
                  "cpu_ms_per_row": statistics.median(cpu), "cpu_ms_per_row_rounds": cpu,
                  "wall_ms_per_row": statistics.median(w for w, _ in times["after"]),
                  "reference_cpu_ms_per_row": statistics.median(c for _, c in times["reference"]),
                  "reference_wall_ms_per_row": statistics.median(w for w, _ in times["reference"])}
        if times["before"]:
            # NOTE(bench): a round's routes see the same rows: their ratio within the round moves less than
            # either figure does from round to round on a shared machine
            ratios = [a / b for a, (_, b) in zip(cpu, times["before"])]
            result |= {"before_cpu_ms_per_row": statistics.median(c for _, c in times["before"]),
                       "before_cpu_ms_per_row_rounds": [c for _, c in times["before"]],
                       "before_wall_ms_per_row": statistics.median(w for w, _ in times["before"]),
                       "after_over_before_rounds": ratios, "after_over_before": statistics.median(ratios)}
        results.append(result)
        before_note = (f"; before {result['before_cpu_ms_per_row']:6.3f}, rounds "
                       f"{', '.join(f'{t:.3f}' for t in result['before_cpu_ms_per_row_rounds'])}; "
                       f"after / before {result['after_over_before']:.2f}" if times["before"] else "")
        print(f"  {vocab:>7} {name:<30} {result['cpu_ms_per_row']:7.3f} ms/row CPU "
              f"(wall {result['wall_ms_per_row']:.3f}; rounds {', '.join(f'{t:.3f}' for t in cpu)}{before_note}; "
              f"reference {result['reference_cpu_ms_per_row']:6.3f})", file=sys.stderr)
    return results


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(dict.fromkeys(r["model"] for r in results))  # one panel per row source, in run order
    fig, axes = plt.subplots(1, len(sources), figsize=(6.5 * len(sources), 5.0), squeeze=False)
    for ax, source in zip(axes[0], sources):
        rows = [r for r in results if r["model"] == source]
        vocab = rows[0]["vocab"]
        y = np.arange(len(rows))
        bars = [("reference_cpu_ms_per_row", "before issue 25 (float64 cumsum per row)", "#bbbbbb")]
        if "before_cpu_ms_per_row" in rows[0]:
            bars.append(("before_cpu_ms_per_row", f"before ({rows[0].get('before_git', 'other tree')})", "#9ecae1"))
        bars.append(("cpu_ms_per_row", f"after ({rows[0].get('git', 'this tree')})", "#2b7bba"))
        height = 0.8 / len(bars)
        for j, (key, label, color) in enumerate(bars):
            ax.barh(y - 0.4 + height * (len(bars) - 1 - j + 0.5), [r[key] for r in rows], height, label=label,
                    color=color)
        target = 0.3 if vocab < 100_000 else 1.0
        ax.axvline(target, color="#d62728", linestyle="--", label=f"target {target} ms")
        ax.set_yticks(y, [r["case"] for r in rows])
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("CPU ms per row (batch 8, median of rounds)")
        ax.set_title(f"{source} (vocabulary {vocab:,})")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", action="append", type=Path, default=[],
                        help="a model folder whose logits to sample (repeatable); default: the pulled default model")
    parser.add_argument("--synthetic", action="append", type=int, default=[], metavar="VOCAB",
                        help="also rows of this width shaped like a model's (Gumbel tail, a few strong tokens), "
                             "for a vocabulary whose model folder is not at hand (repeatable)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64, help="logit rows collected per model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-s", type=float, default=0.3, help="seconds of repeats per timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--case", action="append", default=[], choices=[name for name, _ in CASES],
                        help="only this case (repeatable; default: all)")
    parser.add_argument("--before", metavar="DIR_OR_REV",
                        help="another checkout (a directory) or a git revision of this repository whose "
                             "engine.sampler to time beside this tree's, in the same rounds")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    if not args.model_dir and not args.synthetic:
        from engine.builder.pull import pull_model

        args.model_dir = [pull_model(progress=False)]
    tags = {"git": git_sha(Path(__file__).resolve().parents[1])}
    before = None
    if args.before:
        tree, tags["before_git"] = checkout_of(args.before, Path(tempfile.mkdtemp(prefix="sampler-before-")))
        before = load_sampler(tree)

    def loadavg() -> list[float]:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]

    load = loadavg()
    sources = [(d.name, lambda d=d: collect_logits(d, args.rows, args.threads)) for d in args.model_dir]
    sources += [(f"synthetic-{v}", lambda v=v: synthetic_logits(v, args.rows)) for v in args.synthetic]
    results: list[dict[str, Any]] = []
    for source, logits_of in sources:
        print(f"{source}: {args.rows} logit rows", file=sys.stderr)
        logits = logits_of()
        start = loadavg()
        measured = measure(logits, args.batch, args.rounds, args.min_s, before,
                           [c for c in CASES if not args.case or c[0] in args.case])
        results += [dict(r, model=source, load_average=[start, loadavg()], **tags) for r in measured]
    report = {"load_average_before": load, "load_average_after": loadavg(), **tags, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
