"""PNG plots of bench reports (matplotlib's Agg canvas through Figure, never pyplot's global state).

Reads report dicts only; no HTTP, no engine import.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure


def _x(run: dict) -> float:
    level = run["level"]
    return level["concurrency"] if level.get("concurrency") is not None else level["rate_per_s"]


def _x_label(runs: Sequence[dict]) -> str:
    return "concurrency (closed loop)" if runs and runs[0]["level"].get("concurrency") is not None \
        else "arrival rate (req/s, Poisson)"


def _values(runs: Sequence[dict], *path: str) -> list[float]:
    out = []
    for run in runs:
        value = run["summary"]
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        out.append(np.nan if value is None else float(value))
    return out


def _cdf(ax, values_ms: Sequence[float], label: str, **kw) -> None:
    if not values_ms:
        return
    v = np.sort(np.asarray(values_ms, dtype=np.float64))
    ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label, **kw)


def _runs(report: dict) -> list[dict]:
    return sorted(report["runs"], key=_x)


def plot_report(report: dict, path: str | Path) -> Path:
    """Four panels for one server: output tok/s and per-stream decode tok/s vs level; p50/p99 TTFT vs level; ITL and TTFT CDFs.

    Args:
        report: a bench report (report.build_report).
        path: PNG to write.

    Returns:
        The written path.
    """
    runs = _runs(report)
    xs = [_x(r) for r in runs]
    fig = Figure(figsize=(12, 8), layout="constrained")
    (ax_tput, ax_ttft), (ax_itl, ax_e2e) = fig.subplots(2, 2)
    ax_tput.plot(xs, _values(runs, "output_tokens_per_s"), "o-", label="output tok/s")
    ax_req = ax_tput.twinx()
    ax_req.plot(xs, _values(runs, "decode_tokens_per_s_per_stream"), "s--", color="tab:gray",
                label="decode tok/s per stream (right)")
    ax_req.set_ylabel("tokens/s per stream")
    ax_tput.set(xlabel=_x_label(runs), ylabel="output tokens/s", title="throughput")
    handles = ax_tput.get_legend_handles_labels()[0] + ax_req.get_legend_handles_labels()[0]
    ax_tput.legend(handles=handles, loc="upper left")
    ax_ttft.plot(xs, _values(runs, "ttft", "p50_ms"), "o-", label="p50")
    ax_ttft.plot(xs, _values(runs, "ttft", "p99_ms"), "o--", label="p99")
    ax_ttft.set(xlabel=_x_label(runs), ylabel="ms", title="time to first token")
    ax_ttft.legend()
    for run in runs:
        ok = [r for r in run["records"] if r["error_kind"] is None]
        _cdf(ax_itl, [x for r in ok for x in r["itl_ms"]], run["key"])
        _cdf(ax_e2e, [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None], run["key"])
    ax_itl.set(xlabel="inter-token latency (ms)", ylabel="fraction of tokens", title="ITL distribution")
    ax_e2e.set(xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT distribution")
    for ax in (ax_itl, ax_e2e):
        _auto_log_x(ax)
        _legend(ax)
    _level_axis(ax_tput, xs)
    _level_axis(ax_ttft, xs)
    for ax in (ax_tput, ax_ttft, ax_itl, ax_e2e):
        ax.grid(True, alpha=0.3)
    fig.suptitle(_title(report))
    return save_figure(fig, path)


def plot_compare(reports: Sequence[dict], path: str | Path) -> Path:
    """One figure with every server: tok/s, p50/p99 TTFT vs level, and the ITL CDF at each one's top level.

    Args:
        reports: loaded reports (the first is the baseline of the printed ratios; here all are equal).
        path: PNG to write.
    """
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    ax_tput, ax_ttft, ax_itl = fig.subplots(1, 3)
    colors = [f"C{i}" for i in range(10)]
    for i, report in enumerate(reports):
        runs, color, label = _runs(report), colors[i % 10], report.get("label", f"#{i}")
        xs = [_x(r) for r in runs]
        ax_tput.plot(xs, _values(runs, "output_tokens_per_s"), "o-", color=color, label=label)
        ax_ttft.plot(xs, _values(runs, "ttft", "p50_ms"), "o-", color=color, label=f"{label} p50")
        ax_ttft.plot(xs, _values(runs, "ttft", "p99_ms"), "x--", color=color, label=f"{label} p99")
        if runs:
            top = runs[-1]
            ok = [r for r in top["records"] if r["error_kind"] is None]
            _cdf(ax_itl, [x for r in ok for x in r["itl_ms"]], f"{label} {top['key']}", color=color)
    runs0 = _runs(reports[0]) if reports else []
    xs0 = sorted({_x(r) for report in reports for r in report["runs"]})
    _level_axis(ax_tput, xs0)
    _level_axis(ax_ttft, xs0)
    _auto_log_x(ax_itl)
    ax_tput.set(xlabel=_x_label(runs0), ylabel="output tokens/s", title="throughput")
    ax_ttft.set(xlabel=_x_label(runs0), ylabel="ms", title="time to first token", yscale="log")
    ax_itl.set(xlabel="inter-token latency (ms)", ylabel="fraction of tokens", title="ITL at the top level")
    for ax in (ax_tput, ax_ttft, ax_itl):
        ax.grid(True, alpha=0.3)
        _legend(ax)
    fig.suptitle("comparison: " + ", ".join(r.get("label", "?") for r in reports))
    return save_figure(fig, path)


def _level_axis(ax, xs: Sequence[float]) -> None:
    """Concurrency levels such as 1,2,4,8,16 read best on a log2 axis ticked at the levels themselves."""
    if len(xs) >= 2 and min(xs) > 0 and max(xs) / min(xs) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [f"{x:g}" for x in xs])


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _auto_log_x(ax) -> None:
    """Log x only when the data spans more than a decade (a narrow range reads better linear)."""
    lo, hi = ax.dataLim.x0, ax.dataLim.x1
    if np.isfinite(lo) and np.isfinite(hi) and lo > 0 and hi / lo > 10:
        ax.set_xscale("log")


def _title(report: dict) -> str:
    s = report.get("settings", {})
    cpu = report.get("machine", {}).get("cpu_model") or "?"
    label, model = report.get("label", "?"), s.get("model", "?")
    name = label if label == model else f"{label} ({model})"
    return (f"{name} - prompt {s.get('prompt_tokens', '?')} / output {s.get('output_tokens', '?')} tokens "
            f"- {s.get('mode', 'http')} - {cpu}")


def save_figure(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def plot_features(reports: Sequence[dict], path: str | Path) -> Path:
    """bench.features' figures, one panel per report: multiturn TTFT by turn (every request a dot, the median a
    line) per server; copy decode tokens/s per kind of request (each request a dot, the median a bar)."""
    fig = Figure(figsize=(6.5 * len(reports), 4.4), layout="constrained")
    axes = fig.subplots(1, len(reports), squeeze=False)[0]
    for ax, report in zip(axes, reports):
        names = [t["name"] for t in report["targets"]]
        replies = [r for r in report["replies"] if r["error"] is None]
        if report["scenario"] == "multiturn":
            turns = sorted({r["turn"] for r in replies})
            for i, name in enumerate(names):
                mine = [r for r in replies if r["target"] == name and r["ttft_s"] is not None]
                offset = (i - (len(names) - 1) / 2) * 0.12
                ax.plot([r["turn"] + offset for r in mine], [r["ttft_s"] * 1e3 for r in mine], ".", color=f"C{i}",
                        alpha=0.5, ms=4)
                med = [np.median([r["ttft_s"] * 1e3 for r in mine if r["turn"] == t] or [np.nan]) for t in turns]
                ax.plot(turns, med, "o-", color=f"C{i}", label=name)
            ax.set(xlabel="turn", ylabel="time to first token (ms)", yscale="log", xticks=turns,
                   title=f"multiturn: {len({r['index'] for r in replies})} conversations, "
                         f"{report['settings'].get('system_tokens', '?')}-token system prompt")
        else:
            kinds = ["copy", "free"]
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                for j, kind in enumerate(kinds):
                    rates = [_decode_rate(r) for r in replies if r["target"] == name and r["kind"] == kind]
                    rates = [v for v in rates if v is not None]
                    x = j + (i - (len(names) - 1) / 2) * width
                    if rates:
                        ax.bar(x, np.median(rates), width * 0.9, color=f"C{i}", label=name if j == 0 else None)
                        ax.plot([x] * len(rates), rates, "k.", ms=3)
                        ax.annotate(f"{np.median(rates):.0f}", (x, np.median(rates)), ha="center", va="bottom",
                                    fontsize=8)
            ax.set_xticks(range(len(kinds)), ["copy its input", "free text"])
            ax.set(ylabel="decode tokens/s (1 stream)", title="copy: greedy, single stream")
        ax.grid(True, alpha=0.3)
        _legend(ax)
    cpu = reports[0].get("machine", {}).get("cpu_model") or "?" if reports else "?"
    fig.suptitle(f"prefix reuse and speculative decoding - {cpu}", fontsize=10)
    return save_figure(fig, path)


def _decode_rate(reply: dict) -> float | None:
    n, ttft, e2e = reply.get("num_completion_tokens") or 0, reply.get("ttft_s"), reply.get("e2e_s")
    if ttft is None or e2e is None or n < 2 or e2e <= ttft:
        return None
    return (n - 1) / (e2e - ttft)
