"""Structured outputs over HTTP: a json_schema-constrained stream against a plain one, and grammar compile time.

1. Time per output token (TPOT) of the json_schema scenario against the fixed scenario (same prompts, same
   token counts: the schema cannot complete before max_tokens), at batch 1 and batch 8, in interleaved rounds
   (the order flips each round); the figure is the median over rounds of plain TPOT / constrained TPOT
   (1.0 = constraining is free; the target is >= 0.9).
2. Compile time, end to end: the latency of a 1-token request with a schema the server has not seen, minus
   that of the same request again (its grammar cached), for a typical schema (the scenario's), a typical
   tool list as tool_choice "required" compiles it (an array of {name, arguments} calls, as a JSON schema)
   and as "auto" compiles it (free text, then a call after a "<tool_call>" trigger: a lazy Lark grammar).

Starts `ortserve serve` on --model unless --url is given; a client of the server (no engine import).

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m bench.structured --rounds 3 \\
        --json docs/perf/structured.json --plot docs/perf/structured.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import HttpBackend, HttpSettings, run_load
from bench.scenarios import iter_requests, json_schema_for

TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "search_web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query"], "additionalProperties": False}},
    {"name": "send_email", "parameters": {
        "type": "object", "properties": {"to": {"type": "string", "format": "email"}, "subject": {"type": "string"},
                                         "body": {"type": "string"}, "cc": {"type": "array", "items": {"type": "string"}}},
        "required": ["to", "subject", "body"], "additionalProperties": False}},
    {"name": "create_event", "parameters": {
        "type": "object", "properties": {"title": {"type": "string"}, "date": {"type": "string", "format": "date"},
                                         "duration_minutes": {"type": "integer", "minimum": 5},
                                         "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 10}},
        "required": ["title", "date"], "additionalProperties": False}},
]


def _calls_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """tool_choice "required": one or more calls, each {name: const, arguments: that tool's parameters}."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
         "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}}


def _auto_grammar(tools: list[dict[str, Any]]) -> str:
    """tool_choice "auto": free text; after a "<tool_call>" trigger, one call, then "</tool_call>"."""
    call = {"anyOf": _calls_schema(tools)["items"]["anyOf"]}
    return ("%llguidance {}\nstart: call* TEXT\nTEXT: /(.|\\n)*/\ntrigger[lazy]: TEXT \"<tool_call>\"\n"
            f"call: trigger \"\\n\" %json {json.dumps(call)} \"\\n</tool_call>\"\n")


def _variant(kind: str, k: int) -> dict[str, Any]:
    """Request fields for compile variant ``k`` of ``kind`` (a new name each time: never in the cache)."""
    if kind == "schema":
        schema = json_schema_for(128)
        schema["$defs"]["record"]["properties"][f"extra_{k}"] = {"type": "boolean"}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema}}}
    tools = [{**t, "name": f"{t['name']}_{k}"} for t in TOOLS]
    if kind == "tools_required":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": f"t{k}",
                                                                            "schema": _calls_schema(tools)}}}
    return {"structured_outputs": {"grammar": _auto_grammar(tools)}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model: str, port: int, threads: int, max_batch: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "serve", "--model", model, "--provider", "cpu", "--intra-op-threads",
           str(threads), "--max-batch", str(max_batch), "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    deadline = time.monotonic() + 600  # a first run pulls and converts the model
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError("server did not become ready")


async def _tpot_run(backend: HttpBackend, scenario: str, batch: int, args: argparse.Namespace, seed: int) -> dict:
    """One closed-loop run of ``batch`` users, ``batch`` requests: median TPOT (ms) and sanity counts."""
    specs = iter_requests(scenario, batch, args.prompt_tokens, args.output_tokens, seed=seed)
    result = await run_load(backend, specs, batch, concurrency=batch, label=f"{scenario} b={batch}",
                            progress=False)
    ok = [r for r in result.records if r.ok]
    tpots = [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]
    return {"tpot_ms": statistics.median(tpots) if tpots else None, "num_ok": len(ok),
            "tokens": [r.num_output_tokens for r in ok], "errors": [r.error for r in result.records if not r.ok]}


async def measure_tpot(url: str, args: argparse.Namespace) -> dict:
    backend = HttpBackend(HttpSettings(url=url, model=None, temperature=0.0, request_timeout_s=1800.0),
                          max_connections=16)
    rounds: list[dict] = []
    try:
        await backend.prepare()
        for scenario in ("fixed", "json_schema"):  # warm-up: compile the schema, wake every code path
            await _tpot_run(backend, scenario, 1, args, seed=999)
        for r in range(args.rounds):
            entry: dict[str, Any] = {"round": r}
            for batch in args.batches:
                order = ("fixed", "json_schema") if r % 2 == 0 else ("json_schema", "fixed")
                for scenario in order:
                    entry[f"{scenario}_b{batch}"] = await _tpot_run(backend, scenario, batch, args, seed=r)
                plain, constrained = entry[f"fixed_b{batch}"]["tpot_ms"], entry[f"json_schema_b{batch}"]["tpot_ms"]
                entry[f"ratio_b{batch}"] = plain / constrained if plain and constrained else None
                print(f"round {r} batch {batch}: plain {plain:.2f} ms/token, json_schema {constrained:.2f} "
                      f"ms/token, ratio {entry[f'ratio_b{batch}']:.3f}", flush=True)
            rounds.append(entry)
    finally:
        await backend.aclose()
    summary = {}
    for batch in args.batches:
        ratios = [e[f"ratio_b{batch}"] for e in rounds if e[f"ratio_b{batch}"] is not None]
        summary[f"b{batch}"] = {
            "ratio_median": statistics.median(ratios) if ratios else None, "ratios": ratios,
            "plain_tpot_ms_median": statistics.median(e[f"fixed_b{batch}"]["tpot_ms"] for e in rounds),
            "json_schema_tpot_ms_median": statistics.median(e[f"json_schema_b{batch}"]["tpot_ms"] for e in rounds)}
    return {"rounds": rounds, "summary": summary}


def measure_compile(url: str, model: str, args: argparse.Namespace) -> dict:
    """Cold (new grammar) minus warm (cached) latency of a 1-token chat request, per kind, over variants."""
    out: dict[str, Any] = {}
    with httpx.Client(timeout=600) as client:
        def once(fields: dict[str, Any]) -> float:
            body = {"model": model, "messages": [{"role": "user", "content": "Go."}], "max_tokens": 1,
                    "temperature": 0, **fields}
            t0 = time.perf_counter()
            r = client.post(f"{url}/chat/completions", json=body)
            elapsed = time.perf_counter() - t0
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
            return elapsed * 1e3

        once(_variant("schema", -1))  # the server builds its grammar tokenizer once, at the first grammar
        for kind in ("schema", "tools_required", "tools_auto"):
            deltas, colds = [], []
            for k in range(args.compile_variants):
                fields = _variant(kind, k)
                cold = once(fields)
                warm = statistics.median(once(fields) for _ in range(3))
                deltas.append(cold - warm)
                colds.append(cold)
            out[kind] = {"compile_ms_median": statistics.median(deltas), "compile_ms": deltas,
                         "cold_request_ms": colds}
            print(f"compile {kind}: median {statistics.median(deltas):.1f} ms over {len(deltas)} new grammars",
                  flush=True)
    return out


def plot(results: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_tpot, ax_compile = fig.subplots(1, 2)
    batches = sorted(int(k[1:]) for k in results["tpot"]["summary"])
    xs = range(len(batches))
    summary = results["tpot"]["summary"]
    plain = [summary[f"b{b}"]["plain_tpot_ms_median"] for b in batches]
    constrained = [summary[f"b{b}"]["json_schema_tpot_ms_median"] for b in batches]
    ax_tpot.bar([x - 0.2 for x in xs], plain, 0.4, label="plain")
    ax_tpot.bar([x + 0.2 for x in xs], constrained, 0.4, label="json_schema")
    for x, b in zip(xs, batches):
        ratio = summary[f"b{b}"]["ratio_median"]
        ax_tpot.annotate(f"{ratio:.2f}x", (x, max(plain[x], constrained[x])), ha="center", va="bottom")
    ax_tpot.set_xticks(list(xs), [f"batch {b}" for b in batches])
    ax_tpot.set_ylabel("time per output token (ms, median of rounds)")
    ax_tpot.set_title("plain / json_schema speed (median ratio of rounds)")
    ax_tpot.legend()
    kinds = list(results["compile"])
    ax_compile.bar(kinds, [results["compile"][k]["compile_ms_median"] for k in kinds], color="tab:green")
    ax_compile.set_ylabel("compile time over HTTP (ms, median)")
    ax_compile.set_title("grammar compile (new grammar - cached)")
    fig.suptitle(f"structured outputs, {results['model']} on CPU (shared 2-core machine)")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server's base URL (.../v1); default: start one on --model")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="what the started server serves")
    ap.add_argument("--threads", type=int, default=2, help="the started server's intra-op threads")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--compile-variants", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--plot", help="write a PNG here")
    args = ap.parse_args(argv)

    server = None
    url = args.url
    if url is None:
        port = _free_port()
        server = _start_server(args.model, port, args.threads, max(8, *args.batches))
        url = f"http://127.0.0.1:{port}/v1"
    try:
        model = httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]
        results = {"model": model, "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                   "compile": measure_compile(url, model, args), "tpot": asyncio.run(measure_tpot(url, args))}
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    for batch, s in results["tpot"]["summary"].items():
        print(f"{batch}: plain {s['plain_tpot_ms_median']:.2f} ms/token, json_schema "
              f"{s['json_schema_tpot_ms_median']:.2f} ms/token; ratio median {s['ratio_median']:.3f} "
              f"(rounds {[round(r, 3) for r in s['ratios']]})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
