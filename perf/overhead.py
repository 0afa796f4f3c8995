"""HTTP/SSE overhead micro-benchmark: one stream, engine-direct vs a real `ortserve serve`, interleaved.

Runs in one process: the engine in-process (engine-direct), and HTTP clients (a raw httpx SSE reader
and the official `openai` client) against a server it starts on 127.0.0.1. No server import.

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m perf.overhead --runs 7 [--profile out.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from perf.serve import free_port, start_server

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def _thread_cpu_s(pid: int, tid: int) -> float:
    """CPU time of one thread of `pid` in seconds (/proc schedstat: nanoseconds on a CPU)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def _named_threads(pid: int) -> dict[str, int]:
    """Python thread name -> native thread id of process `pid`, read with py-spy dump ({} without py-spy: the
    server's core thread then goes unmeasured, its loop thread and whole process still are)."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        print("overhead: no py-spy in this environment (pip install py-spy): the server's core thread CPU is "
              "not measured", file=sys.stderr)
        return {}
    out = subprocess.run([str(spy), "dump", "-p", str(pid)], capture_output=True, text=True, timeout=30).stdout
    names = {}
    for line in out.splitlines():
        if line.startswith("Thread ") and '"' in line:
            tid = line.split()[1]
            names[line.split('"')[1]] = int(tid, 16) if tid.startswith("0x") else int(tid)
    return names


def _process_cpu_s(pid: int) -> float:
    return sum(_thread_cpu_s(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task"))


def _cpu_probe(pid: int, tids: dict[str, int]):
    """A snapshot function: {label: CPU seconds} of the named threads and the whole process."""
    def snap() -> dict[str, float]:
        out = {label: _thread_cpu_s(pid, tid) for label, tid in tids.items()}
        out["process"] = _process_cpu_s(pid)
        return out
    return snap


class Timing:
    """Arrival times of the chunks that carried text; decode rate excludes the first (prefill) token."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: list[float] = []
        self.tokens = 0

    def mark(self) -> None:
        self.times.append(time.perf_counter())

    def result(self) -> dict[str, float]:
        t = self.times
        decode = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else 0.0
        return {"decode_tok_s": decode, "ttft_ms": (t[0] - self.t0) * 1e3, "chunks": len(t),
                "tokens": self.tokens, "e2e_s": t[-1] - self.t0}


MODEL = {"id": ""}  # the served model name, read from /v1/models


def _body(max_tokens: int, stream_usage: bool = True) -> dict:
    return {"model": MODEL["id"], "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "min_tokens": max_tokens,
            "stream_options": {"include_usage": stream_usage}}


def run_httpx(client: httpx.Client, url: str, max_tokens: int) -> dict[str, float]:
    """A minimal raw SSE consumer: one line read per event, json only for the usage check."""
    timing = Timing()
    with client.stream("POST", f"{url}/v1/chat/completions", json=_body(max_tokens)) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if '"content":"' in line and '"content":""' not in line:
                timing.mark()
            elif '"usage":{' in line:
                timing.tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return timing.result()


def run_openai(client, max_tokens: int) -> dict[str, float]:
    timing = Timing()
    body = _body(max_tokens)
    stream = client.chat.completions.create(
        model=body["model"], messages=body["messages"], max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "min_tokens": max_tokens})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            timing.mark()
        if chunk.usage is not None:
            timing.tokens = chunk.usage.completion_tokens
    return timing.result()


async def _engine_one(engine, prompt_ids: list[int], max_tokens: int, rid: str) -> dict[str, float]:
    from engine.types import SamplingParams

    timing = Timing()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(prompt_ids, params, rid):
        if out.text:
            timing.mark()
        timing.tokens = out.num_generated_tokens
    return timing.result()


def run_genai(runner, max_tokens: int) -> dict[str, float]:
    """onnxruntime-genai on the same folder (perf.genai_driver), timed from its own record."""
    from bench.metrics import RequestRecord

    record = RequestRecord(index=0, start_s=0.0, num_prompt_tokens_target=0, max_tokens=max_tokens)
    runner.generate(PROMPT, max_tokens, record)
    gaps = record.itl_s
    return {"decode_tok_s": len(gaps) / sum(gaps) if gaps else 0.0, "ttft_ms": (record.ttft_s or 0.0) * 1e3,
            "chunks": record.num_chunks, "tokens": record.usage_completion_tokens or 0,
            "e2e_s": record.e2e_s or 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pause-s", type=float, default=0.3, help="idle time between requests (spinning stops)")
    ap.add_argument("--targets", default="engine,httpx,openai", help="any of engine,httpx,openai,genai")
    ap.add_argument("--profile", help="py-spy record the server for the httpx runs into this file (raw)")
    ap.add_argument("--json", help="write every run's figures here")
    args = ap.parse_args(argv)

    from openai import OpenAI

    from engine.async_engine import AsyncEngine
    from engine.builder import pull_model
    from engine.config import EngineConfig

    model_dir = str(pull_model())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(model_dir, port, args.threads)
    spy = None
    try:
        MODEL["id"] = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        engine = AsyncEngine.from_model_dir(model_dir, EngineConfig(provider="cpu", max_batch=8,
                                                                    intra_op_threads=args.threads))
        loop = asyncio.new_event_loop()
        prompt_ids = list(engine.tokenizer.encode(engine.chat_template.render(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True)))
        hclient = httpx.Client(timeout=120)
        oclient = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        targets = args.targets.split(",")
        runners = {
            "engine": lambda i: loop.run_until_complete(_engine_one(engine, prompt_ids, args.max_tokens, f"e{i}")),
            "httpx": lambda i: run_httpx(hclient, url, args.max_tokens),
            "openai": lambda i: run_openai(oclient, args.max_tokens),
        }
        if "genai" in targets:
            from perf.genai_driver import GenaiRunner

            genai = GenaiRunner(model_dir, threads=args.threads)
            runners["genai"] = lambda i: run_genai(genai, args.max_tokens)
        for name in targets:  # warm-up, not recorded
            runners[name](-1)
        if args.profile:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(server.pid),
                                    "-r", "250", "-f", "raw", "-o", args.profile, "--threads"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        srv = _named_threads(server.pid)
        me = os.getpid()
        probes = {
            "engine": _cpu_probe(me, {"loop": me, "core": engine._core.core._thread.native_id}),
            "http": _cpu_probe(server.pid, {"loop": server.pid, **({"core": srv["ortserve-engine-core"]}
                                                                   if "ortserve-engine-core" in srv else {})}),
            "genai": _cpu_probe(me, {"loop": me, "core": me}),
        }
        results: dict[str, list[dict]] = {n: [] for n in targets}
        for i in range(args.runs):
            k = i % len(targets)
            for name in targets[k:] + targets[:k]:
                time.sleep(args.pause_s)
                probe = probes[name if name in ("engine", "genai") else "http"]
                c0 = probe()
                r = runners[name](i)
                c1 = probe()
                for label in c0:  # CPU ms per generated token, per thread
                    r[f"{label}_cpu_ms_per_tok"] = (c1[label] - c0[label]) * 1e3 / max(1, r["tokens"])
                assert r["tokens"] == args.max_tokens, (name, r)
                results[name].append(r)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
        print("CPU ms per token: loop = the event loop thread (the server's, or this process's for engine),"
              " core = the engine thread (runs one of ORT's 2 compute threads), process = all threads (ORT's spinning"
              " included)")
        print(f"{'target':8} {'decode tok/s':>12} {'ttft ms':>8} {'loop':>7} {'core':>8} {'process':>8}")
        for n, m in med.items():
            print(f"{n:8} {m['decode_tok_s']:12.1f} {m['ttft_ms']:8.1f} {m['loop_cpu_ms_per_tok']:7.3f} "
                  f"{m.get('core_cpu_ms_per_tok', float('nan')):8.3f} {m['process_cpu_ms_per_tok']:8.2f}")
        if "engine" in results:
            for n in targets:
                if n == "engine":
                    continue
                ratios = [h["decode_tok_s"] / e["decode_tok_s"] for h, e in zip(results[n], results["engine"])]
                if n == "genai":
                    ratios = [1 / x for x in ratios]
                print(f"{'engine/genai' if n == 'genai' else n + '/engine'} decode ratio: median {statistics.median(ratios):.3f} "
                      f"(per run {', '.join(f'{x:.2f}' for x in ratios)})")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results, "median": med}, indent=1))
        engine.shutdown()
        loop.close()
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
