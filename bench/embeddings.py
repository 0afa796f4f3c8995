"""`ortserve bench --scenario embeddings`: texts per second through /v1/embeddings at each concurrency and batch
size (texts per request), side by side with peer servers (llama.cpp's llama-server --embeddings, a
sentence-transformers server) in the same run: every round runs each level on every target in turn (order
rotating), so load that comes and goes hits them alike; ratios are taken within a round, then the median.

The official openai client (its default base64 encoding), as users call it; no server or engine import.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import httpx
import openai

EMBEDDINGS_SCENARIO = "embeddings"

_WORDS = ("the of and to in is was for on that with as by at from his her an which or are be this had not "
          "but what all were when we there can been has more if will one no would so about out up them some "
          "could into time only new other then than its over also after first two may any where most through "
          "network server latency vector search index memory thread batch window river mountain city garden "
          "music novel report market energy water history science language system model data query document "
          "retrieval answer question problem result method value change study group country health school").split()


def make_texts(num: int, seed: int, min_words: int = 8, max_words: int = 150) -> list[str]:
    """``num`` passages of ``min_words``..``max_words`` words (about 10 to 190 tokens: under a 256 window)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        out.append(" ".join(words).capitalize() + ".")
    return out


@dataclass
class LevelRun:
    """One target at one level in one round."""

    target: str
    round: int
    batch: int  # texts per request
    concurrency: int
    num_requests: int
    num_texts: int = 0
    wall_s: float = 0.0
    num_errors: int = 0
    error: str | None = None
    latencies_s: list[float] | None = None

    @property
    def texts_per_s(self) -> float | None:
        return self.num_texts / self.wall_s if self.num_texts and self.wall_s > 0 else None


class Target:
    """One server's /v1/embeddings (``model``: its first model, or the one asked for)."""

    def __init__(self, name: str, url: str, api_key: str, timeout_s: float, model: str | None) -> None:
        self.name, self.url, self.model = name, url, model
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                       limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
        self.client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, http_client=self._http)

    async def prepare(self) -> None:
        if self.model is None:  # an embedding model's card (ortserve's carry "dimensions"), else the first
            models = await self.client.models.list()
            if not models.data:
                raise RuntimeError(f"{self.url}/models lists no model")
            self.model = next((m.id for m in models.data if (m.model_extra or {}).get("dimensions")),
                              models.data[0].id)

    async def embed(self, texts: list[str]) -> int:
        """Embeds ``texts``; returns how many vectors came back (raises on an error answer)."""
        r = await self.client.embeddings.create(model=self.model, input=texts)
        return len(r.data)

    async def aclose(self) -> None:
        await self.client.close()
        await self._http.aclose()


async def run_level(target: Target, texts: list[str], *, batch: int, concurrency: int, num_requests: int,
                    round_: int) -> LevelRun:
    """``num_requests`` requests of ``batch`` texts each, ``concurrency`` closed-loop clients."""
    run = LevelRun(target.name, round_, batch, concurrency, num_requests, latencies_s=[])
    next_request = iter(range(num_requests))

    async def user() -> None:
        for i in next_request:
            start = (i * batch) % len(texts)
            chunk = [texts[(start + j) % len(texts)] for j in range(batch)]
            t0 = time.perf_counter()
            try:
                num = await target.embed(chunk)  # NOTE(bench): not `+= await`: that reads the count before awaiting
                run.num_texts += num
                run.latencies_s.append(time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - a failed request is a figure
                run.num_errors += 1
                run.error = f"{type(exc).__name__}: {exc}"[:300]

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    run.wall_s = time.perf_counter() - t0
    return run


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[LevelRun], names: list[str]) -> dict:
    """Per level: each target's median texts/s and p50/p99 request latency over rounds, and the median of the
    per-round ratios of the first target (ortserve) to each peer."""
    summary: dict[str, dict] = {}
    levels = sorted({(r.batch, r.concurrency) for r in runs})
    for batch, conc in levels:
        at = [r for r in runs if (r.batch, r.concurrency) == (batch, conc)]
        entry: dict = {"batch": batch, "concurrency": conc, "targets": {}}
        for name in names:
            mine = [r for r in at if r.target == name]
            lat = sorted(x for r in mine for x in (r.latencies_s or []))
            entry["targets"][name] = {
                "texts_per_s": _median([r.texts_per_s for r in mine if r.texts_per_s]),
                "latency_p50_ms": lat[len(lat) // 2] * 1e3 if lat else None,
                "latency_p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3 if lat else None,
                "errors": sum(r.num_errors for r in mine),
            }
        for peer in names[1:]:
            ratios = []
            for round_ in sorted({r.round for r in at}):
                a = next((r.texts_per_s for r in at if r.round == round_ and r.target == names[0]), None)
                b = next((r.texts_per_s for r in at if r.round == round_ and r.target == peer), None)
                if a and b:
                    ratios.append(a / b)
            entry[f"ratio_vs_{peer}"] = _median(ratios)
        summary[f"b{batch}_c{conc}"] = entry
    return summary


def format_summary(summary: dict, names: list[str]) -> str:
    head = f"{'batch':>5} {'conc':>5} " + " ".join(f"{n + ' texts/s':>22}" for n in names) + \
        "".join(f" {'x vs ' + p:>14}" for p in names[1:])
    lines = [head]
    for entry in summary.values():
        cells = [f"{_num(entry['targets'][n]['texts_per_s']):>22}" for n in names]
        ratios = [f"{_x(entry.get(f'ratio_vs_{p}')):>14}" for p in names[1:]]
        lines.append(f"{entry['batch']:>5} {entry['concurrency']:>5} " + " ".join(cells) + " " + " ".join(ratios))
    return "\n".join(lines)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


async def run(args) -> dict:
    """The embeddings scenario of ``args`` (bench/cli.py's namespace) against --url and every --peer-url."""
    labels = args.peer_label or []
    urls = [(args.label or "ortserve", args.url)] + [
        (labels[i] if i < len(labels) else f"peer{i + 1}", url) for i, url in enumerate(args.peer_url or [])]
    targets = [Target(name, url, args.api_key, args.request_timeout, args.model if i == 0 else None)
               for i, (name, url) in enumerate(urls)]
    texts = make_texts(max(256, max(args.batch_sizes) * 4), args.seed)
    runs: list[LevelRun] = []
    try:
        for target in targets:
            await target.prepare()
            for _ in range(max(1, args.warmup)):  # load kernels and pages: unrecorded
                await target.embed(texts[: max(args.batch_sizes)])
        for round_ in range(args.rounds):
            for batch in args.batch_sizes:
                for conc in args.concurrency:
                    # the same number of texts at every level: fewer requests when each carries more texts
                    num_requests = args.num_requests or max(conc, 128 // batch)
                    order = targets[round_ % len(targets):] + targets[:round_ % len(targets)]
                    for target in order:
                        r = await run_level(target, texts, batch=batch, concurrency=conc, num_requests=num_requests,
                                            round_=round_)
                        runs.append(r)
                        if args.progress is not False:
                            print(f"[embeddings] round {round_ + 1}/{args.rounds} batch {batch} conc {conc} "
                                  f"{target.name}: {_num(r.texts_per_s)} texts/s"
                                  + (f" ({r.num_errors} errors: {r.error})" if r.num_errors else ""), file=sys.stderr)
    finally:
        for target in targets:
            await target.aclose()
    from bench.report import git_revision, machine_info

    names = [t.name for t in targets]
    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "compare", "progress")}
    return {"schema": "ortserve-bench-embeddings/1", "scenario": "embeddings", "git": git_revision(),
            "machine": machine_info(), "settings": settings,
            "targets": [{"name": t.name, "url": t.url, "model": t.model} for t in targets],
            "summary": summarize(runs, names), "runs": [asdict(r) for r in runs]}


def plot(report: dict, path) -> object:
    """Texts/s by concurrency, one panel per batch size, a line per target (the medians over rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import save_figure

    names = [t["name"] for t in report["targets"]]
    batches = sorted({e["batch"] for e in report["summary"].values()})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        entries = sorted((e for e in report["summary"].values() if e["batch"] == batch),
                         key=lambda e: e["concurrency"])
        xs = [e["concurrency"] for e in entries]
        for name in names:
            ax.plot(xs, [e["targets"][name]["texts_per_s"] or 0 for e in entries], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("texts / s (median of rounds)")
        ax.set_title(f"{batch} text{'s' if batch > 1 else ''} per request")
        ax.grid(alpha=0.3)
        ax.legend()
    cpu = report.get("machine", {}).get("cpu_model") or "?"
    fig.suptitle(f"/v1/embeddings, {report['targets'][0].get('model')} - {report['settings'].get('rounds')} "
                 f"rounds - {cpu}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
