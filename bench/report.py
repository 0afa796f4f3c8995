"""The bench's JSON report (settings, git revision, machine, every figure, raw per-request timings) and
the `--compare` ratio table. Pure Python; no HTTP, no engine, no plotting import.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from bench.loadgen import RunResult
from bench.metrics import Slo, summarize

SCHEMA = "ortserve-bench/1"
REPO_ROOT = Path(__file__).resolve().parents[1]

# (label, getter path into a run summary, unit, higher is better) for the compare table.
COMPARE_METRICS: tuple[tuple[str, tuple[str, ...], str, bool], ...] = (
    ("out tok/s", ("output_tokens_per_s",), "tok/s", True),
    ("req/s", ("request_throughput_per_s",), "req/s", True),
    ("decode tok/s/stream", ("decode_tokens_per_s_per_stream",), "tok/s", True),
    ("prefill tok/s", ("prefill_tokens_per_s_mean",), "tok/s", True),
    ("TTFT p50", ("ttft", "p50_ms"), "ms", False),
    ("TTFT p99", ("ttft", "p99_ms"), "ms", False),
    ("TPOT p50", ("tpot", "p50_ms"), "ms", False),
    ("ITL p99", ("itl", "p99_ms"), "ms", False),
    ("e2e p50", ("e2e", "p50_ms"), "ms", False),
)


def git_revision(root: Path = REPO_ROOT) -> dict[str, str | bool | None]:
    """The checkout's commit and whether it has uncommitted changes (None when git is unavailable)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": None if status is None else bool(status)}


def machine_info() -> dict:
    """CPU model, logical and physical cores, memory, OS and library versions of this machine."""
    info: dict = {"platform": platform.platform(), "python": platform.python_version(),
                  "cpu_model": platform.processor() or None, "num_cpus_logical": os.cpu_count()}
    try:
        cores: set[tuple[str, str]] = set()
        phys = core = ""
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    info["cpu_model"] = value
                elif key == "physical id":
                    phys = value
                elif key == "core id":
                    core = value
                    cores.add((phys, core))
        info["num_cpus_physical"] = len(cores) or None
    except OSError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    if hasattr(os, "sched_getaffinity"):
        info["num_cpus_usable"] = len(os.sched_getaffinity(0))
    versions = {}
    for dist in ("onnxruntime", "onnxruntime-genai", "openai", "llama_cpp_python", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    info["versions"] = versions
    return info


def run_entry(result: RunResult, *, slo: Slo, concurrency: int | None = None, rate_per_s: float | None = None,
              extra: dict | None = None) -> dict:
    """One level of a report: its key, the figures and the raw per-request records.

    Args:
        result: what loadgen.run_load returned.
        slo: goodput bounds.
        concurrency / rate_per_s: the level (exactly one).
        extra: more fields to keep with this run (e.g. the scenario).

    Returns:
        {"level": {...}, "key": "c=8" | "rate=2", "summary": {...}, "num_not_sent", "rss", "started_at_s" (the wall
        clock the records' start_s count from), "records": [...]}.
    """
    level = {"concurrency": concurrency} if concurrency is not None else {"rate_per_s": rate_per_s}
    return {
        "level": level,
        "key": level_key(level),
        "summary": summarize(result.records, result.duration_s, slo),
        "num_not_sent": result.num_not_sent,
        "rss": result.rss,
        "started_at_s": result.started_at_s,
        **(extra or {}),
        "records": [r.to_json() for r in result.records],
    }


def level_key(level: dict) -> str:
    if level.get("concurrency") is not None:
        return f"c={level['concurrency']}"
    return f"rate={level['rate_per_s']:g}"


def build_report(label: str, settings: dict, runs: list[dict]) -> dict:
    """The whole JSON document (``settings`` must already be free of secrets)."""
    return {
        "schema": SCHEMA,
        "label": label,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": settings,
        "git": git_revision(),
        "machine": machine_info(),
        "runs": runs,
    }


def write_report(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return path


def load_report(path: str | Path) -> dict:
    report = json.loads(Path(path).read_text(encoding="utf-8"))
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an ortserve bench report (schema {report.get('schema')!r}, "
                         f"expected {SCHEMA!r})")
    return report


def metric(summary: dict, path: Sequence[str]) -> float | None:
    value: object = summary
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def compare(reports: Sequence[dict]) -> list[dict]:
    """Ratios of every report to the first one, level by level.

    Args:
        reports: loaded reports; the first is the baseline.

    Returns:
        One row per (level key present in the baseline, report): {"key", "label", "values": {metric: v},
        "ratios": {metric: v / baseline v}} (ratio None when either side is missing or the baseline is 0).
    """
    base_runs = {run["key"]: run for run in reports[0]["runs"]}
    rows = []
    for key, base in base_runs.items():
        for report in reports:
            run = next((r for r in report["runs"] if r["key"] == key), None)
            if run is None:
                continue
            values, ratios = {}, {}
            for name, path, _, _ in COMPARE_METRICS:
                v, b = metric(run["summary"], path), metric(base["summary"], path)
                values[name] = v
                ratios[name] = (v / b) if (v is not None and b) else None
            rows.append({"key": key, "label": report.get("label", "?"), "values": values, "ratios": ratios})
    return rows


def format_compare(rows: list[dict]) -> str:
    """A plain-text table: each cell "value (ratio to the first report)"."""
    names = [m[0] for m in COMPARE_METRICS]
    header = ["level", "server", *names]
    lines = [header]
    for row in rows:
        cells = [row["key"], row["label"]]
        for name in names:
            v, r = row["values"][name], row["ratios"][name]
            cells.append("-" if v is None else f"{v:.1f} ({r:.2f}x)" if r is not None else f"{v:.1f}")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "-" * len(out[0]))
    base = rows[0]["label"] if rows else "?"
    return "\n".join(out) + (f"\nratio = value / the first file's ({base}); throughputs (tok/s, req/s): higher is "
                             f"better; latencies (ms): lower is better.\n")


def format_summary(run: dict) -> str:
    """One line per level for the terminal."""
    s = run["summary"]

    def ms(d: dict, key: str) -> str:
        return "-" if d.get(key) is None else f"{d[key]:.1f}"

    errors = ",".join(f"{k}={v}" for k, v in sorted(s["errors"].items())) or "0"
    good = s["goodput"]
    return (f"{run['key']}: {s['num_ok']}/{s['num_requests']} ok (errors {errors}, not sent {run['num_not_sent']}) "
            f"in {s['duration_s']:.1f}s | out {s['output_tokens_per_s']:.1f} tok/s, "
            f"{s['request_throughput_per_s']:.2f} req/s | TTFT p50 {ms(s['ttft'], 'p50_ms')} "
            f"p99 {ms(s['ttft'], 'p99_ms')} ms | TPOT p50 {ms(s['tpot'], 'p50_ms')} ms | ITL p50 "
            f"{ms(s['itl'], 'p50_ms')} p99 {ms(s['itl'], 'p99_ms')} ms | goodput "
            f"{good['requests_per_s']:.2f} req/s")
