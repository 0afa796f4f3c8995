"""`ortserve bench --scenario speculative`: speculative decoding as clients see it, side by side with peers (the same
server with drafts off, llama.cpp's llama-server with and without its draft model), in interleaved rounds.

Workloads (written for this bench): code edit (rewrite a given function with one change: the answer copies most of
its input), free chat (open questions), JSON (an answer asked for as a JSON object in the prompt, no grammar), each at
the given temperatures and stream counts. Per cell and target: completion tokens per second of wall time (each of the
``streams`` clients sends ``requests`` requests one after another, streamed), the same after the first token (the
prompt left out: what drafts can speed up) and the time to it, draft acceptance where the server reports it
(ortserve's vLLM-named /metrics, per position; llama-server's response ``timings``), and at temperature 0 whether the
texts equal the first target's. Ratios come from the same round, so load that comes and goes hits every target alike.

The official openai client, as users take it; no server or engine import.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai

SPECULATIVE_SCENARIO = "speculative"

CODE = '''def summarize_orders(orders, tax_rate=0.2):
    """Group orders by customer and return totals."""
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["unit_price"]
        if order.get("discount"):
            amount = amount - amount * order["discount"]
        if customer not in totals:
            totals[customer] = {"count": 0, "net": 0.0, "gross": 0.0}
        totals[customer]["count"] += 1
        totals[customer]["net"] += amount
        totals[customer]["gross"] += amount * (1 + tax_rate)
    result = []
    for customer, entry in sorted(totals.items()):
        result.append({"customer": customer, "count": entry["count"],
                       "net": round(entry["net"], 2), "gross": round(entry["gross"], 2)})
    return result
'''
CODE_CHANGES = (
    "Rename the variable `totals` to `by_customer`.",
    "Change the default tax rate from 0.2 to 0.25.",
    "Round the amounts to 3 decimal places instead of 2.",
    "Rename the function to `customer_totals`.",
)
CHAT = (
    "Why do leaves change colour in autumn? Explain it to a curious ten-year-old.",
    "What are the main differences between a violin and a viola?",
    "Give me some advice for my first week at a new job.",
    "Describe how a bill becomes a law in a parliamentary democracy.",
)
JSON_ASKS = (
    "Return a JSON object describing a fictional book: title, author, year, genres (a list), and a one-sentence "
    "summary. Output only the JSON.",
    "Return a JSON object for a weather report of a city of your choice: city, date, temperature_c, conditions, and "
    "hourly (a list of 4 objects with hour and temperature_c). Output only the JSON.",
    "Return a JSON object describing a user profile: name, email, age, interests (a list of 3), and address (an "
    "object with street, city and country). Output only the JSON.",
    "Return a JSON array of 3 products, each with id, name, price and in_stock. Output only the JSON.",
)
WORKLOADS = ("code_edit", "chat", "json")


def messages_of(workload: str, i: int) -> list[dict[str, str]]:
    """The i-th request's messages of a workload."""
    if workload == "code_edit":
        change = CODE_CHANGES[i % len(CODE_CHANGES)]
        text = f"{change} Reply with the whole rewritten function only.\n\n```python\n{CODE}```"
    elif workload == "chat":
        text = CHAT[i % len(CHAT)]
    else:
        text = JSON_ASKS[i % len(JSON_ASKS)]
    return [{"role": "user", "content": text}]


@dataclass
class Target:
    label: str
    url: str  # OpenAI base URL (…/v1)
    model: str | None = None


@dataclass
class CellRun:
    """One target's run of one cell in one round."""

    tokens: int
    wall_s: float
    texts: list[str]
    drafted: float | None  # draft tokens during the run (None: not reported)
    accepted: float | None
    per_pos: list[float] | None  # accepted tokens by draft position during the run
    ttft_s: float = 0.0  # the requests' summed times to their first content token
    decode_s: float = 0.0  # the requests' summed times from their first content token to their last chunk
    decode_tokens: int = 0  # the requests' completion tokens after the first

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first per second after the first (one stream's decode rate; the prompt left out)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


async def _metrics(http: httpx.AsyncClient, target: Target) -> dict[str, float] | None:
    """ortserve's vLLM-named spec_decode counters (summed over models), or None where the server has none."""
    base = target.url.rstrip("/").removesuffix("/v1")
    try:
        text = (await http.get(f"{base}/metrics", timeout=10)).text
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total'
                     r'\{([^}]*)\} ([0-9.e+-]+)$', line)
        if not m:
            continue
        kind, labels, value = m.group(1), m.group(2), float(m.group(3))
        if kind == "accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            kind = f"pos_{pos.group(1)}" if pos else kind
        out[kind] = out.get(kind, 0.0) + value
    return out or None


async def run_cell(client: openai.AsyncOpenAI, http: httpx.AsyncClient, target: Target, workload: str,
                   temperature: float, streams: int, requests: int, max_tokens: int, seed: int) -> CellRun:
    """``streams`` clients, each sending ``requests`` requests one after another; tokens from each response's usage."""
    before = await _metrics(http, target)
    texts: list[str] = [""] * (streams * requests)
    tokens = 0
    llama_drafted = llama_accepted = 0.0
    llama_seen = False

    ttft = decode = 0.0
    decode_tokens = 0

    async def one_stream(s: int) -> None:
        nonlocal tokens, llama_drafted, llama_accepted, llama_seen, ttft, decode, decode_tokens
        for r in range(requests):
            i = s * requests + r
            # streamed, so that the time to the first token (the prompt) and the decode after it are told apart
            start = time.perf_counter()
            first = last = None
            parts: list[str] = []
            used = 0
            for attempt in range(3):
                try:
                    stream = await client.chat.completions.create(
                        model=target.model or "default", messages=messages_of(workload, i), max_tokens=max_tokens,
                        temperature=temperature, seed=seed + i, stream=True, stream_options={"include_usage": True},
                        extra_body={"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0})
                    break
                except openai.APIConnectionError:
                    # NOTE(bench): a kept-alive connection the server closed between two requests (llama-server
                    # does) fails before the request is sent: open a new one, no more than twice
                    if attempt == 2:
                        raise
                    start = time.perf_counter()
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                    first = now if first is None else first
                    last = now
                if chunk.usage:
                    used = chunk.usage.completion_tokens
                timings = (chunk.model_extra or {}).get("timings") or {}
                if "predicted_n" in timings and not used:  # llama-server's count, where it sends no usage
                    used = int(timings["predicted_n"])
                if "draft_n" in timings:  # llama-server's per-response draft counts (on its last chunk)
                    llama_seen = True
                    llama_drafted += timings.get("draft_n", 0)
                    llama_accepted += timings.get("draft_n_accepted", 0)
            texts[i] = "".join(parts)
            tokens += used
            # NOTE(bench): an answer whose text came in one chunk (a detokenizer holding back bytes of a character
            # until the end) has no time after its first token to measure: left out of the rate, not counted as 0 s
            if first is not None and last is not None and last > first and used > 1:
                ttft += first - start
                decode += last - first
                decode_tokens += used - 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one_stream(s) for s in range(streams)))
    wall = time.perf_counter() - t0
    phases = (ttft, decode, decode_tokens)
    after = await _metrics(http, target)
    if before is not None and after is not None:
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        npos = max((int(k[4:]) + 1 for k in delta if k.startswith("pos_")), default=0)
        return CellRun(tokens, wall, texts, delta.get("draft_tokens"), delta.get("accepted_tokens"),
                       [delta.get(f"pos_{i}", 0.0) for i in range(npos)], *phases)
    if llama_seen:
        return CellRun(tokens, wall, texts, llama_drafted, llama_accepted, None, *phases)
    return CellRun(tokens, wall, texts, None, None, None, *phases)


def _first_difference(a: str, b: str) -> int | None:
    """The first character where two texts part (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


WARMUP_MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]


async def warm_up(client: openai.AsyncOpenAI, target: Target, n: int) -> None:
    """``n`` unrecorded requests before the first cell: a server's first runs (its allocations, page faults, the
    kernels' first calls) would otherwise fall on the first cell's first target alone. A prompt no workload shares,
    so the measured prompts stay cold in round 1 for every target."""
    for _ in range(n):
        await client.chat.completions.create(model=target.model or "default", messages=WARMUP_MESSAGES,
                                             max_tokens=16, temperature=0.0)


async def run_bench(targets: list[Target], *, workloads: list[str], temperatures: list[float], streams: list[int],
                    rounds: int, requests: int, max_tokens: int, seed: int = 0, warmup: int = 1,
                    progress: bool = True) -> dict[str, Any]:
    """Every cell on every target, ``rounds`` times (the targets' order rotated each round), after ``warmup``
    unrecorded requests to each target; the report."""
    cells = [(w, t, s) for w in workloads for t in temperatures for s in streams]
    runs: dict[tuple, dict[str, list[CellRun]]] = {c: {t.label: [] for t in targets} for c in cells}
    async with httpx.AsyncClient() as http:
        clients = {t.label: openai.AsyncOpenAI(base_url=t.url, api_key="EMPTY", max_retries=0, timeout=900)
                   for t in targets}
        for t in targets:
            if t.model is None:
                t.model = (await clients[t.label].models.list()).data[0].id
            await warm_up(clients[t.label], t, warmup)
        for rnd in range(rounds):
            for n, cell in enumerate(cells):
                order = targets[(rnd + n) % len(targets):] + targets[:(rnd + n) % len(targets)]
                for t in order:
                    run = await run_cell(clients[t.label], http, t, *cell, requests, max_tokens, seed)
                    runs[cell][t.label].append(run)
                    if progress:
                        print(f"[speculative] round {rnd + 1}/{rounds} {cell[0]} T={cell[1]} streams={cell[2]} "
                              f"{t.label}: {run.tok_s:.2f} tok/s"
                              + (f", {run.accepted:.0f}/{run.drafted:.0f} drafts kept" if run.drafted else ""),
                              file=sys.stderr, flush=True)
        for c in clients.values():
            await c.close()
    return _report(targets, cells, runs, rounds=rounds, requests=requests, max_tokens=max_tokens, seed=seed,
                   warmup=warmup)


def _report(targets: list[Target], cells: list[tuple], runs: dict, **settings: Any) -> dict[str, Any]:
    first = targets[0].label
    out_cells = []
    for cell in cells:
        entry: dict[str, Any] = {"workload": cell[0], "temperature": cell[1], "streams": cell[2], "targets": {}}
        for t in targets:
            rs: list[CellRun] = runs[cell][t.label]
            drafted = [r.drafted for r in rs if r.drafted is not None]
            accepted = [r.accepted for r in rs if r.accepted is not None]
            per_pos = [r.per_pos for r in rs if r.per_pos]
            width = max((len(p) for p in per_pos), default=0)
            entry["targets"][t.label] = {
                "tok_s": [round(r.tok_s, 3) for r in rs], "median_tok_s": round(statistics.median(r.tok_s for r in rs), 3),
                "tokens": [r.tokens for r in rs],
                # the prompt left out: tokens after the first over the time after the first, and the time to it
                "decode_tok_s": [round(r.decode_tok_s, 3) for r in rs],
                "median_decode_tok_s": round(statistics.median(r.decode_tok_s for r in rs), 3),
                "ttft_ms": [round(1000 * r.ttft_s / max(1, len(r.texts)), 1) for r in rs],
                "draft_tokens": sum(drafted) if drafted else None, "accepted_tokens": sum(accepted) if accepted else None,
                "accepted_per_pos": [sum(p[i] if i < len(p) else 0.0 for p in per_pos) for i in range(width)] or None,
            }
        # ratios in each round against every other target, then the median over rounds
        ratios, decode_ratios = {}, {}
        for t in targets[1:]:
            pairs = list(zip(runs[cell][first], runs[cell][t.label]))
            per_round = [a.tok_s / b.tok_s for a, b in pairs if b.tok_s > 0]
            ratios[f"{first} / {t.label}"] = round(statistics.median(per_round), 3) if per_round else None
            per_round = [a.decode_tok_s / b.decode_tok_s for a, b in pairs if b.decode_tok_s > 0]
            decode_ratios[f"{first} / {t.label}"] = round(statistics.median(per_round), 3) if per_round else None
        entry["ratios"] = ratios  # wall time, the prompt included
        entry["decode_ratios"] = decode_ratios  # after the first token
        if cell[1] == 0:
            same = {}
            for t in targets[1:]:
                a, b = runs[cell][first][0].texts, runs[cell][t.label][0].texts
                diffs = [_first_difference(x, y) for x, y in zip(a, b)]
                same[t.label] = {"equal": sum(d is None for d in diffs), "of": len(diffs),
                                 "first_difference_chars": [d for d in diffs if d is not None]}
            entry["greedy_texts_vs_first"] = same
        out_cells.append(entry)
    return {"scenario": SPECULATIVE_SCENARIO, "targets": [t.__dict__ for t in targets], "settings": settings,
            "cells": out_cells}


def format_summary(report: dict[str, Any]) -> str:
    labels = [t["label"] for t in report["targets"]]
    lines = [f"{'workload':10} {'T':>4} {'streams':>7} " + " ".join(f"{lb[:18]:>18}" for lb in labels)
             + "   ratios (median of rounds)"]
    for c in report["cells"]:
        toks = " ".join(f"{c['targets'][lb]['median_tok_s']:>18.2f}" for lb in labels)
        ratios = ", ".join(f"{k.split(' / ')[1]}: {v:.2f}x" for k, v in c["ratios"].items() if v is not None)
        decode = ", ".join(f"{k.split(' / ')[1]}: {v:.2f}x" for k, v in c.get("decode_ratios", {}).items()
                           if v is not None)
        lines.append(f"{c['workload']:10} {c['temperature']:>4} {c['streams']:>7} {toks}   {ratios}"
                     + (f"; after the first token {decode}" if decode else ""))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> str:
    """Median tok/s per cell and target (bars), and accepted draft tokens by position per ortserve target (the share
    of checks whose token at that position was kept)."""
    from matplotlib.figure import Figure

    labels = [t["label"] for t in report["targets"]]
    cells = report["cells"]
    fig = Figure(figsize=(max(8.0, 0.9 * len(cells) * len(labels) / 2), 7.5), layout="constrained")
    ax, ax2 = fig.subplots(2, 1, height_ratios=(3, 2))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(cells))]
        ax.bar(xs, [c["targets"][label]["median_tok_s"] for c in cells], width * 0.9, color=f"C{i}", label=label)
        for x, c in zip(xs, cells):
            ax.plot([x] * len(c["targets"][label]["tok_s"]), c["targets"][label]["tok_s"], "k.", ms=3)
    ax.set_xticks(range(len(cells)), [f"{c['workload']}\nT={c['temperature']} x{c['streams']}" for c in cells],
                  fontsize=8)
    ax.set(ylabel="completion tokens/s (all streams)", title="speculative decoding: tok/s per workload")
    ax.legend(fontsize=8)
    for i, label in enumerate(labels):
        for j, c in enumerate(cells):
            t = c["targets"][label]
            per_pos = t.get("accepted_per_pos")
            if not per_pos or not per_pos[0]:
                continue
            share = [p / per_pos[0] for p in per_pos]
            ax2.plot(range(1, len(share) + 1), share, "o-" if j % 2 == 0 else "s--", ms=3, color=f"C{j % 10}",
                     label=f"{label}: {c['workload']} T={c['temperature']} x{c['streams']}")
    ax2.set(xlabel="draft position", ylabel="kept, relative to position 1",
            title="acceptance by draft position (ortserve's vllm:spec_decode_num_accepted_tokens_per_pos)")
    ax2.title.set_fontsize(9)
    if ax2.lines:
        ax2.legend(fontsize=6, ncol=2)
    fig.savefig(path, dpi=110)
    return path


async def run(args: Any) -> dict[str, Any]:
    """The scenario from `ortserve bench` arguments: --url and each --peer-url are targets (--label, --peer-label)."""
    urls = [args.url, *(args.peer_url or [])]
    names = [args.label or "ortserve", *(args.peer_label or [])]
    names += [f"peer{i}" for i in range(len(names), len(urls))]
    targets = [Target(name, url) for name, url in zip(names, urls)]
    return await run_bench(targets, workloads=args.workloads, temperatures=args.temperatures,
                           streams=args.concurrency or [1], rounds=args.rounds, requests=args.num_requests or 2,
                           max_tokens=args.output_tokens or 128, seed=args.seed,
                           warmup=max(0, getattr(args, "warmup", 1)), progress=args.progress is not False)
