"""`ortserve bench --scenario sizes`: ortserve against llama.cpp's llama-server on one GGUF at the sizes people run
(issue 45), as a user meets them: the conversion (wall time, peak RSS), each server's load time and peak RSS, KV bytes
per token, decode tokens/s at 1 and 2 streams and the time to first token of a long prompt, through the same OpenAI
client path as the other scenarios.

One server runs at a time (an 8B model twice does not fit beside other work on a 24 GiB machine); rounds alternate
which goes first, so load that comes and goes hits both alike, and every ratio is taken within a round (then the
median). Each round's long prompt is new (no prefix cache on either side).

Starts the servers as subprocesses (``ortserve serve``, the given llama-server binary); imports no engine module.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.loadgen import HttpBackend, HttpSettings
from bench.metrics import RequestRecord
from bench.scenarios import RequestSpec, make_prompt

SIZES_SCENARIO = "sizes"
OURS, PEER = "ortserve", "llama-server"
READY_TIMEOUT_S = 1800.0  # an 8B model's load on 2 busy cores takes minutes
GIB = 1 << 30


@dataclass(frozen=True)
class SizesSettings:
    """What one sizes run compares (the CLI fills it)."""

    gguf: Path
    llama_server: Path
    model_dir: Path | None = None  # an ortserve folder of the GGUF already converted (else converted here, timed)
    convert_args: tuple[str, ...] = ()  # extra `ortserve convert` flags, e.g. ("--kv-dtype", "float16")
    ours_args: tuple[str, ...] = ()  # extra `ortserve serve` flags
    peer_args: tuple[str, ...] = ()  # extra llama-server flags, e.g. ("--poll", "0")
    threads: int = 2
    slots: int = 2
    context: int = 4096  # tokens per slot, both servers
    rounds: int = 2
    output_tokens: int = 32
    ttft_prompt_tokens: int = 2000
    seed: int = 0
    port: int = 18461
    work_dir: Path = Path("bench/results/sizes")


# --- processes -----------------------------------------------------------------------------------------------------


def tree_rss_bytes(pid: int) -> int:
    """RSS of ``pid`` and its descendants (an engine process beside the server), 0 once gone."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status", encoding="ascii") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", encoding="ascii") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, StopIteration, ValueError):
            continue
    return total


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` and its descendants have used so far."""
    total, stack, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", encoding="ascii") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, IndexError, ValueError):
            continue
    return total


def convert(settings: SizesSettings, out_dir: Path) -> dict:
    """``ortserve convert`` as a user runs it: wall time and the process's peak RSS (its own rusage)."""
    cmd = [sys.executable, "-m", "server", "convert", str(settings.gguf), str(out_dir), "--overwrite",
           *settings.convert_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {os.waitstatus_to_exitcode(status)})")
    return {"command": " ".join(cmd[1:]), "wall_s": wall, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "gguf_bytes": settings.gguf.stat().st_size, "folder_bytes": _folder_bytes(out_dir)}


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


class Server:
    """One server process: started, waited for, its RSS sampled, stopped."""

    def __init__(self, name: str, cmd: list[str], url: str, log_path: Path) -> None:
        self.name, self.cmd, self.url, self.log_path = name, cmd, url, log_path
        self.proc: subprocess.Popen | None = None
        self.peak_rss_bytes = 0
        self.load_s: float | None = None

    def start(self) -> None:
        """Starts the process and waits until GET /health answers 200 (the load time, from the process start)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        health = self.url.removesuffix("/v1") + "/health"
        while time.perf_counter() - t0 < READY_TIMEOUT_S:
            self.sample()
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited while loading (exit {self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(health, timeout=5).status_code == 200:
                    self.load_s = time.perf_counter() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready after {READY_TIMEOUT_S:.0f} s; see {self.log_path}")

    def sample(self) -> None:
        if self.proc is not None:
            self.peak_rss_bytes = max(self.peak_rss_bytes, tree_rss_bytes(self.proc.pid))

    async def sample_forever(self, interval_s: float = 0.5) -> None:
        while True:
            self.sample()
            await asyncio.sleep(interval_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server_commands(settings: SizesSettings, model_dir: Path) -> dict[str, tuple[list[str], str]]:
    """Each server's command line and base URL: the same threads, slots and context per slot."""
    ours_port, peer_port = settings.port, settings.port + 1
    ours = [sys.executable, "-m", "server", "serve", "--model", str(model_dir), "--provider", "cpu", "--host",
            "127.0.0.1", "--port", str(ours_port), "--max-batch", str(settings.slots), "--max-model-len",
            str(settings.context), "--intra-op-threads", str(settings.threads), "--log-level", "info",
            *settings.ours_args]
    peer = [str(settings.llama_server), "-m", str(settings.gguf), "--host", "127.0.0.1", "--port", str(peer_port),
            "-t", str(settings.threads), "-tb", str(settings.threads), "-np", str(settings.slots),
            "-c", str(settings.slots * settings.context), *settings.peer_args]
    return {OURS: (ours, f"http://127.0.0.1:{ours_port}/v1"), PEER: (peer, f"http://127.0.0.1:{peer_port}/v1")}


# --- measurements --------------------------------------------------------------------------------------------------


def decode_rate(record: RequestRecord) -> float | None:
    """Tokens per second after the first token: (completion tokens - 1) / (last chunk - first chunk)."""
    tokens = record.usage_completion_tokens or record.num_chunks
    if record.error_kind or record.ttft_s is None or record.last_chunk_s is None or tokens < 2:
        return None
    span = record.last_chunk_s - record.ttft_s
    return (tokens - 1) / span if span > 0 else None


async def _requests(url: str, model: str | None, specs: list[RequestSpec]) -> list[RequestRecord]:
    """Sends ``specs`` at once (greedy, ignore_eos) through the OpenAI client; their records."""
    backend = HttpBackend(HttpSettings(url=url, model=model, endpoint="completions", request_timeout_s=3600.0))
    try:
        await backend.prepare()
        records = [RequestRecord(index=s.index, start_s=0.0, num_prompt_tokens_target=s.num_prompt_tokens_target,
                                 max_tokens=s.max_tokens) for s in specs]
        await asyncio.gather(*(backend.send(s, r) for s, r in zip(specs, records)))
        return records
    finally:
        await backend.aclose()


async def measure(server: Server, settings: SizesSettings, round_index: int, encode) -> dict:
    """One server's figures in one round: warm-up, decode at 1 and at ``slots`` streams, the long prompt's TTFT."""
    sampler = asyncio.create_task(server.sample_forever())
    try:
        rng = random.Random(settings.seed * 1000 + round_index)
        short = [make_prompt(32, rng, encode=encode) for _ in range(settings.slots)]
        await _requests(server.url, None, [RequestSpec(0, short[0], 32, 4)])  # warm-up
        pid = server.proc.pid if server.proc else 0
        cpu0 = tree_cpu_s(pid)
        one = await _requests(server.url, None, [RequestSpec(0, short[0], 32, settings.output_tokens)])
        cpu1 = tree_cpu_s(pid)
        many = await _requests(server.url, None, [RequestSpec(i, short[i], 32, settings.output_tokens)
                                                  for i in range(settings.slots)])
        cpu2 = tree_cpu_s(pid)
        ttft = None
        if settings.ttft_prompt_tokens:
            long_prompt = make_prompt(settings.ttft_prompt_tokens, rng, encode=encode)
            (ttft,) = await _requests(server.url, None, [RequestSpec(0, long_prompt, settings.ttft_prompt_tokens, 1)])
    finally:
        sampler.cancel()
    rates = [decode_rate(r) for r in many]
    errors = [r.error for r in (*one, *many, *([ttft] if ttft else [])) if r.error]
    tokens_1 = sum(r.usage_completion_tokens or r.num_chunks for r in one)
    tokens_n = sum(r.usage_completion_tokens or r.num_chunks for r in many)
    return {
        "decode_tok_s_1": decode_rate(one[0]),
        f"decode_tok_s_{settings.slots}": sum(rates) if all(r is not None for r in rates) else None,
        # NOTE(bench): CPU seconds per output token (the server's process tree, prompt included): on a shared machine
        # the wall clock also counts the time others held the cores; this counts only the server's own work
        "cpu_s_per_token_1": (cpu1 - cpu0) / tokens_1 if tokens_1 else None,
        f"cpu_s_per_token_{settings.slots}": (cpu2 - cpu1) / tokens_n if tokens_n else None,
        "ttft_s": ttft.ttft_s if ttft is not None and not ttft.error_kind else None,
        "ttft_prompt_tokens": ttft.usage_prompt_tokens if ttft is not None else None,
        "errors": errors,
    }


def kv_bytes_per_token_ours(model_dir: Path) -> int:
    """Keys and values of every layer for one token, from the folder (genai_config and the graph's past-key type)."""
    import onnx  # the graph's structure only, no weights

    decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    graph = onnx.load(str(model_dir / decoder.get("filename", "model.onnx")), load_external_data=False).graph
    elem = next(i.type.tensor_type.elem_type for i in graph.input if i.name.startswith("past_key_values"))
    width = 2 if elem in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16) else 4
    return 2 * decoder["num_hidden_layers"] * decoder["num_key_value_heads"] * decoder["head_size"] * width


def model_params(gguf_path: Path) -> int:
    """The GGUF's weights, counted in elements (the size the model is known by)."""
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(str(gguf_path)).tensors)


def kv_bytes_per_token_peer(gguf_path: Path) -> int:
    """llama.cpp's KV for one token: its default f16 cache (``-ctk f16 -ctv f16``), from the GGUF's header."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def value(key: str, default: int | None = None) -> int:
        if key not in fields:
            if default is None:
                raise KeyError(key)
            return default
        field = fields[key]
        return int(field.parts[field.data[0]][0])

    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    heads = value(f"{arch}.attention.head_count")
    head = value(f"{arch}.attention.key_length", value(f"{arch}.embedding_length") // heads)
    return 2 * value(f"{arch}.block_count") * value(f"{arch}.attention.head_count_kv", heads) * head * 2


# --- the run -------------------------------------------------------------------------------------------------------


def run(settings: SizesSettings) -> dict:
    """The whole comparison; returns the report (see the module docstring)."""
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    conversion = None
    model_dir = settings.model_dir
    if model_dir is None:
        model_dir = settings.work_dir / f"{settings.gguf.stem}-ortserve"
        print(f"[sizes] converting {settings.gguf} -> {model_dir}", file=sys.stderr)
        conversion = convert(settings, model_dir)
    from tokenizers import Tokenizer  # the folder's own, so prompts are as long as asked

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    commands = server_commands(settings, model_dir)
    rounds = []
    for r in range(settings.rounds):
        order = (OURS, PEER) if r % 2 == 0 else (PEER, OURS)
        entry: dict = {"round": r, "order": list(order), "load_average": _load_average()}
        for name in order:
            cmd, url = commands[name]
            server = Server(name, cmd, url, settings.work_dir / f"{name}.log")
            print(f"[sizes] round {r + 1}/{settings.rounds}: {name}", file=sys.stderr)
            try:
                server.start()
                figures = asyncio.run(measure(server, settings, r, encode))
            finally:
                server.stop()
            entry[name] = {"load_s": server.load_s, "peak_rss_bytes": server.peak_rss_bytes, **figures}
            print(f"[sizes]   {json.dumps(entry[name])}", file=sys.stderr)
        rounds.append(entry)
    report = {
        "scenario": SIZES_SCENARIO,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(settings).items()},
        "model_dir": str(model_dir),
        "model_params": model_params(settings.gguf),
        "conversion": conversion,
        "kv_bytes_per_token": {OURS: kv_bytes_per_token_ours(model_dir), PEER: kv_bytes_per_token_peer(settings.gguf)},
        "rounds": rounds,
    }
    report["summary"] = summarize(report)
    return report


def _load_average() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


METRICS = ("decode_tok_s_1", "decode_tok_s_{slots}", "cpu_s_per_token_1", "cpu_s_per_token_{slots}", "ttft_s",
           "load_s", "peak_rss_bytes")


def summarize(report: dict) -> dict:
    """Each metric's median per server, and the median of the within-round ratios ours / llama-server."""
    slots = report["settings"]["slots"]
    out: dict = {}
    for template in METRICS:
        key = template.format(slots=slots)
        row: dict = {}
        for name in (OURS, PEER):
            values = [r[name][key] for r in report["rounds"] if r[name].get(key) is not None]
            row[name] = statistics.median(values) if values else None
        ratios = [r[OURS][key] / r[PEER][key] for r in report["rounds"]
                  if r[OURS].get(key) and r[PEER].get(key)]
        row["ratio"] = statistics.median(ratios) if ratios else None
        if any(v is not None for v in row.values()):
            out[key] = row
    return out


def format_summary(report: dict) -> str:
    lines = [f"{'metric':<22}{OURS:>14}{PEER:>14}{'ratio':>8}"]
    for key, row in report["summary"].items():
        def fmt(v: float | None, unit: bool = True) -> str:
            if v is None:
                return "-"
            return f"{v / GIB:.2f} GiB" if unit and key.endswith("_bytes") else f"{v:.2f}"
        lines.append(f"{key:<22}{fmt(row[OURS]):>14}{fmt(row[PEER]):>14}{fmt(row['ratio'], False):>8}")
    kv = report["kv_bytes_per_token"]
    lines.append(f"{'kv_bytes_per_token':<22}{kv[OURS]:>14}{kv[PEER]:>14}{kv[OURS] / kv[PEER]:>8.2f}")
    if report.get("conversion"):
        c = report["conversion"]
        lines.append(f"conversion: {c['wall_s']:.0f} s, peak RSS {c['peak_rss_bytes'] / GIB:.2f} GiB, "
                     f"GGUF {c['gguf_bytes'] / GIB:.2f} GiB -> folder {c['folder_bytes'] / GIB:.2f} GiB")
    return "\n".join(lines)


def plot(report: dict, path) -> object:
    """One bar pair (ours, llama-server) per metric, each round a dot; the conversion in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import save_figure

    slots = report["settings"]["slots"]
    panels = [("decode_tok_s_1", "decode tok/s, 1 stream", 1.0), (f"decode_tok_s_{slots}",
              f"decode tok/s, {slots} streams", 1.0), ("cpu_s_per_token_1", "CPU s a token, 1 stream", 1.0),
              ("ttft_s", f"TTFT s, {report['settings']['ttft_prompt_tokens']}-token prompt", 1.0),
              ("load_s", "load s", 1.0), ("peak_rss_bytes", "peak RSS GiB", 1 / GIB)]
    panels = [p for p in panels if p[0] in report["summary"]]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(3.2 * (len(panels) + 1), 3.6))
    for ax, (key, title, scale) in zip(axes, panels):
        for i, name in enumerate((OURS, PEER)):
            values = [r[name][key] * scale for r in report["rounds"] if r[name].get(key) is not None]
            if values:
                ax.bar(i, statistics.median(values), color=("C0", "C1")[i], alpha=0.7)
                ax.plot([i] * len(values), values, "k.")
        ratio = report["summary"][key].get("ratio")
        ax.set_title(title + (f"\nratio {ratio:.2f}" if ratio else ""), fontsize=9)
        ax.set_xticks([0, 1], [OURS, PEER], fontsize=8)
    kv = report["kv_bytes_per_token"]
    axes[-1].bar([0, 1], [kv[OURS] / 1024, kv[PEER] / 1024], color=["C0", "C1"], alpha=0.7)
    axes[-1].set_title("KV KiB per token", fontsize=9)
    axes[-1].set_xticks([0, 1], [OURS, PEER], fontsize=8)
    c = report.get("conversion")
    conv = f"; conversion {c['wall_s']:.0f} s, peak RSS {c['peak_rss_bytes'] / GIB:.2f} GiB" if c else ""
    fig.suptitle(f"{Path(report['settings']['gguf']).name} on {report['settings']['threads']} threads{conv}",
                 fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
