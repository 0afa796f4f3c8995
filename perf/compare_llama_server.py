"""ortserve against llama.cpp's C++ llama-server on this machine's CPU, as clients call them (issue 25).

Both servers hold the same weights (the default model's GGUF and ortserve's conversion of it) and 8 slots. Each
round measures every scenario on both servers in turn (order rotating), the idle server paused (SIGSTOP) while the
other runs, so neither takes the other's cores:

- ``t0-same``: temperature 0, one prompt shared by every request (what a greedy benchmark sends);
- ``t1-distinct``: temperature 1 (what the openai SDK samples at when a call sets none), a prompt of its own per
  request.

and for each, one stream (decode tokens/s per request: tokens after the first over the time between the first and
the last) and 8 closed-loop streams (aggregate output tokens/s over the run, TTFT p50). Ratios are ours over
llama-server's within a round; the summary gives their medians (``summary.json``, ``summary.md``, ``compare.png``).

    python -m perf.compare_llama_server --ours URL --ours-pid PID --peer URL --peer-pid PID --out DIR
(perf/compare_llama_server.sh starts both servers and runs this.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.scenarios import COMMON_WORDS, index_words

SCENARIOS = {"t0-same": (0.0, False), "t1-distinct": (1.0, True)}  # temperature, distinct prompts


def prompt_of(index: int, words: int, distinct: bool, seed: int) -> str:
    """A prompt of ``words`` common words; distinct ones start with their index (no shared prefix)."""
    rng = random.Random(seed * 7919 + (index if distinct else 0))
    head = list(index_words(index)) if distinct else []
    return " ".join(head + [rng.choice(COMMON_WORDS) for _ in range(words - len(head))])


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      temperature: float) -> dict:
    """One streamed chat completion: TTFT, the time between the first and last content, output tokens. A kept-alive
    connection the server closed before answering is retried once on a new one (llama-server closes idle ones)."""
    try:
        return await _stream_once(client, url, model, prompt, max_tokens, temperature)
    except httpx.RemoteProtocolError:
        return await _stream_once(client, url, model, prompt, max_tokens, temperature)


async def _stream_once(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                       temperature: float) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = None
    async with client.stream("POST", f"{url}/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
    if first is None:
        raise RuntimeError(f"{url}: no content streamed")
    return {"ttft_s": first - t0, "decode_s": last - first, "tokens": tokens or max_tokens, "end_s": last - t0}


async def run_mode(url: str, model: str, streams: int, num_requests: int, words: int, max_tokens: int,
                   temperature: float, distinct: bool, seed: int) -> dict:
    """``num_requests`` requests over ``streams`` closed-loop streams; per-request records and the wall time."""
    queue = list(range(num_requests))
    records: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def user() -> None:
            while queue:
                i = queue.pop(0)
                records.append(await one_request(client, url, model, prompt_of(i, words, distinct, seed),
                                                 max_tokens, temperature))
        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(streams)))
        wall = time.perf_counter() - t0
    decode = [(r["tokens"] - 1) / r["decode_s"] for r in records if r["decode_s"] > 0]
    return {"wall_s": wall, "records": records,
            "decode_tok_s": statistics.median(decode) if decode else None,
            "aggregate_tok_s": sum(r["tokens"] for r in records) / wall,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in records)}


@contextmanager
def only(paused: list[int]):
    """Run with the ``paused`` processes stopped (SIGSTOP), resumed afterwards whatever happens."""
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.2)
        yield
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)


def model_id(url: str) -> str:
    return httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summarize(rounds: list[dict]) -> dict:
    """Per scenario: each round's ratios (ours / llama-server) and their medians."""
    out = {}
    for name in SCENARIOS:
        rows = [r[name] for r in rounds if name in r]
        per = {"single_stream": [ratio(r["ours"]["single"]["decode_tok_s"], r["peer"]["single"]["decode_tok_s"])
                                 for r in rows],
               "aggregate_8": [ratio(r["ours"]["streams"]["aggregate_tok_s"], r["peer"]["streams"]["aggregate_tok_s"])
                               for r in rows],
               "ttft_p50_8": [ratio(r["ours"]["streams"]["ttft_p50_s"], r["peer"]["streams"]["ttft_p50_s"])
                              for r in rows]}
        absolute = {f"{who}_{key}": statistics.median(r[who][mode][field] for r in rows)
                    for who in ("ours", "peer")
                    for key, mode, field in (("single_tok_s", "single", "decode_tok_s"),
                                             ("aggregate_tok_s", "streams", "aggregate_tok_s"),
                                             ("ttft_p50_s", "streams", "ttft_p50_s"))}
        out[name] = {"ratios": per, "median": {k: statistics.median(v) for k, v in per.items() if all(v)},
                     "absolute": absolute}
    return out


def markdown(summary: dict, rounds: int) -> str:
    lines = [f"ortserve / llama-server, medians of {rounds} rounds (each round's ratios in brackets)", "",
             "| | single stream (decode tok/s) | 8-stream aggregate | 8-stream TTFT p50 (lower is better) |",
             "|---|---|---|---|"]
    for name, s in summary.items():
        cells = []
        for key in ("single_stream", "aggregate_8", "ttft_p50_8"):
            each = " / ".join(f"{x:.2f}" for x in s["ratios"][key] if x)
            cells.append(f"{s['median'].get(key, float('nan')):.2f}x ({each})")
        a = s["absolute"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append(f"| {name}, absolute (ours vs llama-server) | {a['ours_single_tok_s']:.0f} vs "
                     f"{a['peer_single_tok_s']:.0f} | {a['ours_aggregate_tok_s']:.0f} vs "
                     f"{a['peer_aggregate_tok_s']:.0f} | {a['ours_ttft_p50_s'] * 1e3:.0f} vs "
                     f"{a['peer_ttft_p50_s'] * 1e3:.0f} ms |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("single_stream", "single stream", 1.1), ("aggregate_8", "8-stream aggregate", 1.5),
            ("ttft_p50_8", "8-stream TTFT p50\n(ours / theirs, lower is better)", 1.0)]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, (key, title, target) in zip(axes, keys):
        names = list(summary)
        values = [summary[n]["median"].get(key, 0) for n in names]
        ax.bar(names, values, color=["#4c72b0", "#dd8452"][: len(names)])
        for n, v in zip(names, values):
            ax.annotate(f"{v:.2f}x", (names.index(n), v), ha="center", va="bottom")
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target}x")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("ortserve / llama.cpp llama-server, same weights, 8 slots, CPU (ratio of medians)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> dict:
    targets = {"ours": (args.ours, args.ours_pid), "peer": (args.peer, args.peer_pid)}
    models = {who: model_id(url) for who, (url, _) in targets.items()}
    rounds = []
    for rnd in range(args.rounds):
        result: dict = {}
        for name, (temperature, distinct) in SCENARIOS.items():
            order = list(targets) if (rnd + list(SCENARIOS).index(name)) % 2 == 0 else list(targets)[::-1]
            result[name] = {}
            for who in order:
                url, _ = targets[who]
                others = [p for w, (_, p) in targets.items() if w != who]
                with only(others):
                    await run_mode(url, models[who], 1, 1, args.prompt_words, 8, temperature, distinct, 999)  # warm
                    single = await run_mode(url, models[who], 1, args.single_requests, args.prompt_words,
                                            args.output_tokens, temperature, distinct, rnd)
                    streams = await run_mode(url, models[who], args.streams, args.batch_requests, args.prompt_words,
                                             args.output_tokens, temperature, distinct, 100 + rnd)
                result[name][who] = {"single": single, "streams": streams}
                print(f"[compare] round {rnd + 1} {name} {who}: single {single['decode_tok_s']:.1f} tok/s, "
                      f"{args.streams} streams {streams['aggregate_tok_s']:.1f} tok/s, TTFT p50 "
                      f"{streams['ttft_p50_s'] * 1e3:.0f} ms", flush=True)
        rounds.append(result)
    return {"settings": vars(args) | {"models": models}, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.compare_llama_server", description=__doc__.splitlines()[0])
    ap.add_argument("--ours", required=True, help="ortserve's OpenAI base URL")
    ap.add_argument("--ours-pid", type=int, required=True)
    ap.add_argument("--peer", required=True, help="llama-server's OpenAI base URL")
    ap.add_argument("--peer-pid", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--single-requests", type=int, default=4)
    ap.add_argument("--batch-requests", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=100)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(main_async(args))
    report["settings"]["out"] = str(args.out)
    (args.out / "compare.json").write_text(json.dumps(report, indent=1))
    summary = summarize(report["rounds"])
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary, args.rounds)
    (args.out / "summary.md").write_text(text)
    plot(summary, args.out / "compare.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
