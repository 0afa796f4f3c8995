"""ortserve against llama.cpp on the same GGUF, single stream, 2 threads each: decode and prompt tokens/s.

Three targets in one process tree, interleaved round by round (the order rotating), so machine load hits all
alike; every ratio is taken within a round and the summary gives the medians:
  ortserve  the engine in-process (AsyncEngine on the converted folder; what `ortserve serve` runs, no HTTP);
  bare      a bare ONNX Runtime loop on the same folder (perf.ceiling.BareLoop): what any server over this
            graph could reach at most;
  llama.cpp llama-cpp-python's low-level loop on the GGUF (tests/reference/llamacpp_peer.py in the dev-only .bench-venv),
            eval() per token and a numpy argmax, the same work as ours.
  http      with --http: a real `ortserve serve` on the folder (same threads, one slot, the same drafts setting),
            streamed over /v1/completions by the official openai client with the prompt as token ids: what a
            user sees.
Decode: a 32-token prompt, OUTPUT tokens greedy (eos ignored), tokens after the first over the time after it.
The engine drafts as it does by default (prompt lookup: its output often repeats, and drafts pay off there);
`--speculative-tokens 0` gives it the same work per token as the other two. Rounds record the drafts.
Prompt: PREFILL tokens in, tokens/s = PREFILL / time to the first token (llama.cpp: one eval of the prompt).

    .venv/bin/python -m perf.compare_gguf --gguf .cache/gguf/gemma-3-270m-q4_k_m.gguf \\
        --model-dir .cache/gemma3-270m --rounds 5 --json docs/perf/gemma3-cpu.json --plot docs/perf/gemma3-cpu.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.reference.gguf_parity import DEFAULT_PEER_PYTHON, PROMPTS, Peer, peer_works

ROOT = Path(__file__).resolve().parents[1]


async def _engine_run(engine, prompt: list[int], max_tokens: int, rid: str) -> tuple[list[int], list[float]]:
    from engine.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    stamps: list[float] = []
    async for out in engine.generate(prompt, params, rid):
        if out.token_ids:
            tokens += out.token_ids
            stamps += [time.perf_counter()] * len(out.token_ids)
    return tokens, stamps


def ortserve_decode(engine, prompt: list[int], n: int) -> tuple[float, list[int]]:
    tokens, stamps = asyncio.run(_engine_run(engine, prompt, n, f"dec-{time.monotonic_ns()}"))
    return (len(tokens) - 1) / (stamps[-1] - stamps[0]), tokens


def ortserve_prefill(engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    asyncio.run(_engine_run(engine, prompt, 1, f"pre-{time.monotonic_ns()}"))
    return len(prompt) / (time.perf_counter() - t0)


def _http_target(args: argparse.Namespace, prompt: list[int], max_len: int):
    """A real server on the folder and a function streaming one greedy completion from it: (process, decode fn).

    Decode rate as for the engine: completion tokens after the first over the time after the first text chunk.
    """
    from openai import OpenAI

    from perf.serve import free_port, start_server

    extra = ["--max-batch", "1", "--max-model-len", str(max_len)]
    if args.speculative_tokens is not None:
        extra += ["--speculative-tokens", str(args.speculative_tokens)]
    port = free_port()
    server = start_server(str(args.model_dir), port, args.threads, *extra)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def decode() -> tuple[float, list[int]]:
        stamps: list[float] = []
        tokens = 0
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=args.output_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        assert tokens == args.output_tokens, tokens
        return (tokens - 1) / (stamps[-1] - stamps[0]), []

    return server, decode


def _drafts(engine) -> tuple[int, int]:
    """The engine's speculative draft tokens so far: (proposed, accepted)."""
    extra = engine.stats().extra
    return int(extra["spec_draft_tokens_total"]), int(extra["spec_accepted_tokens_total"])


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--peer-python", type=Path, default=DEFAULT_PEER_PYTHON)
    parser.add_argument("--no-bare", action="store_true", help="skip the bare ONNX Runtime loop")
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help="the engine's prompt-lookup drafts (default: the engine's default; 0 = off, the same "
                        "work per token as llama.cpp's loop and the bare loop)")
    parser.add_argument("--omp-wait-policy", default="PASSIVE", choices=["PASSIVE", "ACTIVE", "default"],
                        help="llama.cpp's OpenMP waiting (default PASSIVE: on a shared, oversubscribed machine its "
                        "spinning threads collapse, see docs/perf/gemma3.md; ACTIVE is llama.cpp's own default)")
    parser.add_argument("--http", action="store_true", help="add a real `ortserve serve` streamed by the openai client")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    why = peer_works(args.peer_python)
    if why:
        print(f"compare_gguf: {why}", file=sys.stderr)
        return 1

    from tokenizers import Tokenizer

    from perf.ceiling import BareLoop
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    tok = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    text_ids = tok.encode(" ".join(PROMPTS * 20), add_special_tokens=True).ids
    short = text_ids[:32]
    long = text_ids[: args.prefill_tokens]
    max_len = args.prefill_tokens + args.output_tokens + 64
    spec = {} if args.speculative_tokens is None else {"speculative_tokens": args.speculative_tokens}
    engine = AsyncEngine.from_model_dir(args.model_dir, EngineConfig(
        provider="cpu", intra_op_threads=args.threads, max_batch=1, max_model_len=max_len, seed=0, **spec))
    speculative_tokens = engine.config.speculative_tokens
    bare = None if args.no_bare else BareLoop(args.model_dir, 1, args.threads, max_len)
    peer = Peer(args.gguf, python=args.peer_python, threads=args.threads, n_ctx=max_len,
                omp_wait_policy=None if args.omp_wait_policy == "default" else args.omp_wait_policy)
    info = peer.ask(cmd="info")

    def llama_decode() -> tuple[float, list[int]]:
        r = peer.ask(cmd="generate", ids=short, max_tokens=args.output_tokens)
        return (len(r["tokens"]) - 1) / r["decode_s"], r["tokens"]

    def llama_prefill() -> float:
        return len(long) / peer.ask(cmd="generate", ids=long, max_tokens=1)["prompt_s"]

    def bare_decode() -> tuple[float, list[int]]:
        first = bare.prefill(short)
        rate = bare.decode(first, len(short), args.output_tokens - 1)
        return rate, [int(first[0])] + bare.tokens[0].tolist()

    decode = {"ortserve": lambda: ortserve_decode(engine, short, args.output_tokens), "llama.cpp": llama_decode}
    server = None
    if args.http:
        server, http_decode = _http_target(args, short, max_len)
        decode["http"] = http_decode
    prefill = {"ortserve": lambda: ortserve_prefill(engine, long), "llama.cpp": llama_prefill}
    if bare is not None:
        decode["bare"] = bare_decode
    # warm-up: every target once (kernels, caches, page faults)
    for fn in [*decode.values(), *prefill.values()]:
        fn()
    rounds = []
    names = list(decode)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        load = os.getloadavg()[0]
        dec, pre, toks = {}, {}, {}
        drafted, accepted = _drafts(engine)
        for name in order:
            dec[name], toks[name] = decode[name]()
        drafted, accepted = (now - before for now, before in zip(_drafts(engine), (drafted, accepted)))
        for name in order:
            if name in prefill:
                pre[name] = prefill[name]()
        same = sum(a == b for a, b in zip(toks["ortserve"], toks["llama.cpp"]))
        rounds.append({"order": order, "load_avg": load, "decode_tok_s": dec, "prompt_tok_s": pre,
                       "decode_ratio": dec["ortserve"] / dec["llama.cpp"],
                       "prompt_ratio": pre["ortserve"] / pre["llama.cpp"],
                       "bare_decode_ratio": dec["bare"] / dec["llama.cpp"] if "bare" in dec else None,
                       "engine_vs_bare": dec["ortserve"] / dec["bare"] if "bare" in dec else None,
                       "http_decode_ratio": dec["http"] / dec["llama.cpp"] if "http" in dec else None,
                       "http_vs_engine": dec["http"] / dec["ortserve"] if "http" in dec else None,
                       "greedy_tokens_equal_to_llamacpp": f"{same}/{len(toks['ortserve'])}",
                       "ortserve_draft_tokens": {"proposed": drafted, "accepted": accepted}})
        print(json.dumps(rounds[-1]), flush=True)
    peer.close()
    engine.shutdown()
    if server is not None:
        server.terminate()
        server.wait(30)

    def med(key: str, sub: str | None = None) -> float | None:
        vals = [r[key][sub] if sub else r[key] for r in rounds]
        return statistics.median(vals) if None not in vals else None

    summary = {
        "gguf": args.gguf.name, "model_dir": str(args.model_dir), "threads": args.threads, "num_rounds": args.rounds,
        "output_tokens": args.output_tokens, "prefill_tokens": args.prefill_tokens, "git": git_sha(),
        "omp_wait_policy": args.omp_wait_policy, "speculative_tokens": speculative_tokens, "load_avg_during": [r["load_avg"] for r in rounds],
        "cpu": platform.processor() or platform.machine(), "llama_cpp": info,
        "median": {"decode_ratio": med("decode_ratio"), "prompt_ratio": med("prompt_ratio"),
                   "bare_decode_ratio": med("bare_decode_ratio"), "engine_vs_bare": med("engine_vs_bare"),
                   "http_decode_ratio": med("http_decode_ratio"), "http_vs_engine": med("http_vs_engine"),
                   "decode_tok_s": {n: med("decode_tok_s", n) for n in names},
                   "prompt_tok_s": {n: med("prompt_tok_s", n) for n in prefill}},
        "rounds": rounds,
    }
    print(json.dumps(summary["median"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        plot(summary, args.plot)
    return 0


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in [(axes[0], "decode_tok_s", "decode tok/s, 1 stream"),
                           (axes[1], "prompt_tok_s", f"prompt tok/s, {summary['prefill_tokens']} tokens")]:
        names = list(summary["median"][key])
        for i, name in enumerate(names):
            vals = [r[key][name] for r in summary["rounds"]]
            ax.scatter([i] * len(vals), vals, color="gray", s=12, zorder=3)
            ax.bar(i, summary["median"][key][name], color=["tab:blue", "tab:orange", "tab:green", "tab:gray"][i % 4])
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
    ratio = summary["median"]
    fig.suptitle(f"{summary['gguf']}, {summary['threads']} threads: decode {ratio['decode_ratio']:.2f}x, "
                 f"prompt {ratio['prompt_ratio']:.2f}x llama.cpp (medians of {len(summary['rounds'])} rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
