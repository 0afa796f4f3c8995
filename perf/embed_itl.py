"""Does embedding work stall running chat streams? The inter-token latency (ITL) of 4 running chat streams while
one /v1/embeddings request of 64 texts is embedded, on servers that differ only in --embedding-nice, against
the same streams with no embedding work, in rounds (servers alternating), through the openai client.

    perf/embed_itl.sh    (starts the servers: --embedding-nice 10 (the default) and 0)
    .venv/bin/python -m perf.embed_itl --url NAME=URL [--url NAME=URL ...] --out FILE.json --plot FILE.png

Each round and server: 4 streams start (greedy, ignore_eos); once every stream has its first token, the
embedding request is sent; the ITLs whose gap lies inside the embedding request's window are its figures, and
the same streams' gaps before the request are the baseline. The streams are then cut.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import openai

from bench.embeddings import make_texts

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_round(url: str, *, streams: int, texts: list[str], chat_model: str | None, embed_model: str | None,
                    max_tokens: int, lead_in_s: float) -> dict:
    """One measurement: (baseline gaps, gaps inside the embedding window, embedding seconds)."""
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    models = [m.id for m in (await client.models.list()).data]
    chat_model = chat_model or models[0]
    embed_model = embed_model or models[-1]
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    started = [asyncio.Event() for _ in range(streams)]
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        s = await client.chat.completions.create(model=chat_model, messages=PROMPT, max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals[i].append(time.perf_counter())
                started[i].set()
            if stop.is_set():
                break
        await s.close()

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    await asyncio.gather(*(e.wait() for e in started))
    await asyncio.sleep(lead_in_s)  # baseline gaps of the running streams
    t0 = time.perf_counter()
    r = await client.embeddings.create(model=embed_model, input=texts)
    t1 = time.perf_counter()
    assert len(r.data) == len(texts)
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    during, before = [], []
    for times in arrivals:
        for a, b in zip(times, times[1:]):
            if b > t0 and a < t1:  # a gap overlapping the embedding request
                during.append(b - a)
            elif b <= t0 and a >= times[0]:
                before.append(b - a)
    return {"embed_s": t1 - t0, "during_s": during, "before_s": before}


async def main_async(args) -> dict:
    texts = make_texts(args.texts, args.seed)
    targets = [tuple(u.split("=", 1)) for u in args.url]
    rounds = []
    for k in range(args.rounds):
        order = targets[k % len(targets):] + targets[:k % len(targets)]
        for name, url in order:
            res = await one_round(url, streams=args.streams, texts=texts, chat_model=args.chat_model,
                                  embed_model=args.embed_model, max_tokens=args.max_tokens, lead_in_s=args.lead_in)
            res.update(target=name, round=k)
            rounds.append(res)
            print(f"[embed_itl] round {k + 1} {name}: embed {res['embed_s']:.2f} s, ITL p99 during "
                  f"{1e3 * (_p(res['during_s'], 0.99) or 0):.1f} ms, before {1e3 * (_p(res['before_s'], 0.99) or 0):.1f} ms",
                  flush=True)
    summary = {}
    for name, _ in targets:
        mine = [r for r in rounds if r["target"] == name]
        during = [g for r in mine for g in r["during_s"]]
        before = [g for r in mine for g in r["before_s"]]
        summary[name] = {
            "itl_p50_ms_during": 1e3 * (_p(during, 0.5) or 0), "itl_p99_ms_during": 1e3 * (_p(during, 0.99) or 0),
            "itl_p50_ms_before": 1e3 * (_p(before, 0.5) or 0), "itl_p99_ms_before": 1e3 * (_p(before, 0.99) or 0),
            "itl_max_ms_during": 1e3 * max(during, default=0), "embed_s_median": statistics.median(
                r["embed_s"] for r in mine), "num_gaps_during": len(during), "num_gaps_before": len(before)}
    from bench.report import git_revision, machine_info

    return {"schema": "ortserve-embed-itl/1", "git": git_revision(), "machine": machine_info(),
            "settings": vars(args), "summary": summary, "rounds": rounds}


def plot(report: dict, path: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in report["summary"]:
        for key, style in (("during_s", "-"), ("before_s", ":")):
            gaps = sorted(1e3 * g for r in report["rounds"] if r["target"] == name for g in r[key])
            if gaps:
                ax.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], style,
                        label=f"{name}, {'while 64 texts embed' if key == 'during_s' else 'before'}")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency of 4 chat streams, ms")
    ax.set_ylabel("fraction of gaps")
    ax.axhline(0.99, color="grey", lw=0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"chat ITL while /v1/embeddings runs - {report['machine'].get('cpu_model', '?')}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", required=True, help="NAME=BASE_URL of a server (repeatable)")
    p.add_argument("--chat-model")
    p.add_argument("--embed-model")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--lead-in", type=float, default=2.0, help="seconds of baseline gaps before the request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    p.add_argument("--plot")
    args = p.parse_args()
    report = asyncio.run(main_async(args))
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        print(f"plot: {plot(report, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
