"""`ortserve bench --scenario decisions`: requests that read logits instead of generating, through HTTP as users send
them (the official openai client's ``decisions.create``; rerank over plain HTTP).

Each round measures, on inputs no earlier request has seen (so the prefix cache only helps within a request):
- the time of one decision with 1, 5 and 20 questions over a ~1,000-token input, and each time over the 1-question
  time of the same round (prefix sharing: the input is prefilled once, each question only its own text);
- decisions per second at each --concurrency (short inputs, 3 questions each);
- the time of one rerank of 8 and of 32 documents.
Ratios are taken within a round, then the median over rounds. No server or engine import.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai

from bench.embeddings import make_texts

DECISIONS_SCENARIO = "decisions"
QUESTION_COUNTS = (1, 5, 20)
RERANK_SIZES = (8, 32)
LONG_INPUT_WORDS = 880  # about 1,000 tokens of the bench's word list (SmolLM2's tokenizer): --input-words


def _question(i: int) -> dict:
    return {"type": "choice", "name": f"q{i}", "instructions": f"Question {i}: which topic does the text cover most?",
            "choices": [{"value": "science"}, {"value": "music"}, {"value": "history"}, {"value": "sports"}]}


# NOTE(bench): every run's inputs start with their own nonce, so a server that ran the bench before holds no prefix of
# them in its cache (a 1-question decision would then cost a copy, not a prefill)
_NONCE = random.SystemRandom().randrange(10**12)


def _long_input(seed: int, words: int = LONG_INPUT_WORDS) -> str:
    return f"Document {_NONCE}-{seed}. " + " ".join(make_texts(1, seed, words, words))


def _process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds so far of process ``pid`` and its descendants (Linux /proc: the server and its
    engine processes, where a decision's work is done), or None when ``pid`` is gone."""
    if pid is None:
        return None
    ticks, todo = 0, [pid]
    while todo:
        proc = Path("/proc") / str(todo.pop())
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            todo += [int(c) for task in (proc / "task").iterdir() for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            if proc.name == str(pid):
                return None
            continue  # a child that ended meanwhile
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Round:
    round: int
    question_times_s: dict[int, float] = field(default_factory=dict)  # questions -> seconds of one decision
    # questions -> the server's CPU seconds (its process and its engine processes) during that decision
    # (--server-pid): the work, which a shared machine's load changes far less than the wall time
    question_cpu_s: dict[int, float] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    input_tokens: dict[int, int] = field(default_factory=dict)
    decisions_per_s: dict[int, float] = field(default_factory=dict)  # concurrency -> decisions (requests) / s
    rerank_times_s: dict[int, float] = field(default_factory=dict)  # documents -> seconds of one rerank
    errors: list[str] = field(default_factory=list)


async def _one_round(client: openai.AsyncOpenAI, http: httpx.AsyncClient, model: str, args, round_: int) -> Round:
    out = Round(round_)
    # 1. prefix sharing: n questions over one long input, in an order that rotates by round (load that comes and goes
    #    on a shared machine then hits each count alike)
    counts = QUESTION_COUNTS[round_ % len(QUESTION_COUNTS):] + QUESTION_COUNTS[:round_ % len(QUESTION_COUNTS)]
    for n in counts:
        cpu0 = _process_cpu_s(args.server_pid)
        t0 = time.perf_counter()
        decision = await client.decisions.create(model=model, input=_long_input(args.seed * 7919 + round_ * 101 + n,
                                                                                   args.input_words),
                                                 questions=[_question(i) for i in range(n)])
        out.question_times_s[n] = time.perf_counter() - t0
        cpu1 = _process_cpu_s(args.server_pid)
        if cpu0 is not None and cpu1 is not None:
            out.question_cpu_s[n] = cpu1 - cpu0
        out.cached_tokens[n] = decision.usage.input_tokens_details.cached_tokens
        out.input_tokens[n] = decision.usage.input_tokens
    for conc in args.concurrency:  # 2. decisions per second, closed loop
        num = args.num_requests or max(8, 2 * conc)
        texts = [f"Ticket {_NONCE}-{round_}-{conc}-{i}. {t}"
                 for i, t in enumerate(make_texts(num, args.seed + 1000 * round_ + conc, 40, 80))]
        todo = iter(range(num))

        async def user(todo=todo, texts=texts) -> None:
            for i in todo:
                try:
                    await client.decisions.create(model=model, input=texts[i], questions=[_question(j) for j in range(3)])
                except Exception as exc:  # noqa: BLE001 - a failed request is a figure
                    out.errors.append(f"{type(exc).__name__}: {exc}"[:200])

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(conc)))
        out.decisions_per_s[conc] = num / (time.perf_counter() - t0)
    for size in RERANK_SIZES:  # 3. rerank
        docs = [f"({_NONCE}) {t}" for t in make_texts(size, args.seed + 50_000 + round_ * 100 + size, 30, 60)]
        t0 = time.perf_counter()
        r = await http.post("/rerank", json={"query": f"Which passage is about science? ({round_})", "documents": docs})
        out.rerank_times_s[size] = time.perf_counter() - t0
        if r.status_code != 200:
            out.errors.append(f"rerank {r.status_code}: {r.text[:200]}")
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(rounds: list[Round]) -> dict:
    """Medians over rounds: each time, the within-round ratio of n questions to 1, decisions/s and rerank times."""
    summary: dict = {"questions": {}, "decisions_per_s": {}, "rerank": {}}
    for n in QUESTION_COUNTS:
        summary["questions"][str(n)] = {
            "time_s": _median([r.question_times_s[n] for r in rounds]),
            "ratio_to_1": _median([r.question_times_s[n] / r.question_times_s[1] for r in rounds]),
            "cpu_s": _median([r.question_cpu_s[n] for r in rounds if n in r.question_cpu_s]),
            "cpu_ratio_to_1": _median([r.question_cpu_s[n] / r.question_cpu_s[1] for r in rounds
                                       if n in r.question_cpu_s and r.question_cpu_s.get(1)]),
            "cached_tokens": _median([float(r.cached_tokens[n]) for r in rounds]),
            "input_tokens": _median([float(r.input_tokens[n]) for r in rounds])}
    for conc in sorted({c for r in rounds for c in r.decisions_per_s}):
        summary["decisions_per_s"][str(conc)] = _median([r.decisions_per_s[conc] for r in rounds])
    for size in RERANK_SIZES:
        summary["rerank"][str(size)] = {"time_s": _median([r.rerank_times_s[size] for r in rounds])}
    summary["errors"] = sum(len(r.errors) for r in rounds)
    return summary


def format_summary(summary: dict, names: list[str] | None = None) -> str:
    lines = ["decisions over a ~1,000-token input (median of rounds):"]
    for n, e in summary["questions"].items():
        lines.append(f"  {n:>2} question(s): {e['time_s'] * 1e3:8.1f} ms  x{e['ratio_to_1']:.2f} of 1 question  "
                     f"cached {e['cached_tokens']:.0f} of {e['input_tokens']:.0f} input tokens"
                     + (f"  server CPU {e['cpu_s']:.2f} s" if e.get("cpu_s") is not None else "")
                     + (f" (x{e['cpu_ratio_to_1']:.2f})" if e.get("cpu_ratio_to_1") is not None else ""))
    for conc, rate in summary["decisions_per_s"].items():
        lines.append(f"  concurrency {conc}: {rate:.2f} decisions/s (3 questions each)")
    for size, e in summary["rerank"].items():
        lines.append(f"  rerank {size} documents: {e['time_s'] * 1e3:.1f} ms")
    if summary["errors"]:
        lines.append(f"  errors: {summary['errors']}")
    return "\n".join(lines)


async def run(args) -> dict:
    """The decisions scenario of ``args`` (bench/cli.py's namespace) against --url."""
    http_client = httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10.0))
    client = openai.AsyncOpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, http_client=http_client)
    http = httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout,
                             headers={"Authorization": f"Bearer {args.api_key}"})
    rounds: list[Round] = []
    try:
        model = args.model or (await client.models.list()).data[0].id
        for _ in range(max(1, args.warmup)):  # sessions' first runs of each shape: unrecorded
            await client.decisions.create(model=model, input=_long_input(-1, args.input_words),
                                          questions=[_question(i) for i in range(5)])
        for round_ in range(args.rounds):
            rounds.append(await _one_round(client, http, model, args, round_))
            if args.progress is not False:
                r = rounds[-1]
                print(f"[decisions] round {round_ + 1}/{args.rounds}: "
                      + " ".join(f"{n}q {r.question_times_s[n] * 1e3:.0f} ms" for n in QUESTION_COUNTS)
                      + f", 5q/1q x{r.question_times_s[5] / r.question_times_s[1]:.2f}", file=sys.stderr)
    finally:
        await http_client.aclose()
        await http.aclose()
    from bench.report import git_revision, machine_info

    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "compare", "progress")}
    return {"schema": "ortserve-bench-decisions/1", "scenario": DECISIONS_SCENARIO, "git": git_revision(),
            "machine": machine_info(), "settings": settings, "targets": [{"name": args.label or "ortserve",
                                                                          "url": args.url, "model": model}],
            "summary": summarize(rounds), "runs": [asdict(r) for r in rounds]}


def plot(report: dict, path) -> object:
    """Time of one decision by its number of questions (with the 1-question time scaled as a reference), and rerank
    time by documents."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import save_figure

    s = report["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ns = [int(n) for n in s["questions"]]
    times = [s["questions"][str(n)]["time_s"] * 1e3 for n in ns]
    left.plot(ns, times, marker="o", label="one decision (median)")
    left.plot(ns, [times[0] * n for n in ns], linestyle="--", color="gray", label="n x one question (no sharing)")
    left.set_xlabel("questions over one ~1,000-token input")
    left.set_ylabel("ms")
    left.set_title("prefix sharing")
    left.grid(alpha=0.3)
    left.legend()
    sizes = [int(k) for k in s["rerank"]]
    right.bar([str(k) for k in sizes], [s["rerank"][str(k)]["time_s"] * 1e3 for k in sizes])
    right.set_xlabel("documents")
    right.set_ylabel("ms per rerank")
    right.set_title("rerank")
    cpu = report.get("machine", {}).get("cpu_model") or "?"
    fig.suptitle(f"decisions and rerank, {report['targets'][0].get('model')} - "
                 f"{report['settings'].get('rounds')} rounds - {cpu}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
