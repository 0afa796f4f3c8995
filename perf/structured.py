"""Structured outputs over HTTP: a json_schema-constrained stream against a plain one, and grammar compile time.

1. Time per output token (TPOT) of the json_schema scenario against the fixed scenario (same prompts, same
   token counts: the schema cannot complete before max_tokens), at batch 1 and batch 8, in interleaved rounds
   (the order flips each round); the figure is the median over rounds of plain TPOT / constrained TPOT
   (1.0 = constraining is free; the target is >= 0.9).
2. Compile time of grammars the server has not seen, for a typical schema (the scenario's), a typical tool list
   as tool_choice "required" compiles it (an array of {name, arguments} calls, as a JSON schema) and as "auto"
   compiles it (free text, then a call after a "<tool_call>" trigger: a lazy Lark grammar). Measured in
   process, in the engine's own StructuredOutputBackend on the model's tokenizer (what a request waits for
   before its first token): end to end, a 1-token request's latency on a shared 2-core machine varies by more
   than a compile takes.

Starts `ortserve serve` on --model unless --url is given, a client of it for the TPOT part; the compile part
reads the model folder and uses engine.structured_output in this process.

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m perf.structured --rounds 5 \\
        --json docs/perf/structured.json --plot docs/perf/structured.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.loadgen import HttpBackend, HttpSettings, run_load
from perf.serve import free_port, start_server
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


def measure_compile(model_dir: Path, args: argparse.Namespace) -> dict:
    """Compile each kind's new variants in the engine's backend on the model's tokenizer; milliseconds."""
    from engine.model_loader import read_model_folder
    from engine.structured_output import StructuredOutputBackend
    from server.openai.protocol import ChatCompletionRequest

    folder = read_model_folder(model_dir)
    backend = StructuredOutputBackend(folder.tokenizer.hf, folder.tokenizer.vocab_size, folder.eos_token_ids,
                                      compile_timeout_s=600.0)
    out: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        backend.start().result()
        out["tokenizer_build_ms"] = (time.perf_counter() - t0) * 1e3
        print(f"grammar tokenizer: built once per engine in {out['tokenizer_build_ms']:.0f} ms", flush=True)
        for kind in ("schema", "tools_required", "tools_auto"):
            times, first_masks = [], []
            bitmask = backend.allocate_bitmask(1)
            for k in range(args.compile_variants):
                body = {"messages": [{"role": "user", "content": "Go."}], **_variant(kind, k)}
                spec = ChatCompletionRequest.model_validate(body).to_sampling_params(1, 64).structured
                t0 = time.perf_counter()
                constraint = backend.constraint_sync(spec)
                times.append((time.perf_counter() - t0) * 1e3)
                # NOTE(bench): llguidance builds lexer states lazily, so a new grammar's first mask costs more
                # than later ones; it is part of the first token's latency, reported beside the compile.
                t0 = time.perf_counter()
                constraint.fill(bitmask, 0)
                first_masks.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                backend.constraint_sync(spec)
                cached = (time.perf_counter() - t0) * 1e3
            out[kind] = {"compile_ms_median": statistics.median(times), "compile_ms": times, "cached_ms": cached,
                         "first_mask_ms_median": statistics.median(first_masks), "first_mask_ms": first_masks}
            print(f"compile {kind}: median {statistics.median(times):.1f} ms over {len(times)} new grammars, "
                  f"first mask {statistics.median(first_masks):.2f} ms (cached compile: {cached:.2f} ms)",
                  flush=True)
    finally:
        backend.shutdown()
    return out


def plot(results: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_tpot, ax_compile = fig.subplots(1, 2)
    batches = sorted(int(k[1:]) for k in results["tpot"]["summary"])
    summary = results["tpot"]["summary"]
    for x, b in enumerate(batches):
        ratios = summary[f"b{b}"]["ratios"]
        ax_tpot.plot([x] * len(ratios), ratios, "o", color="tab:blue", alpha=0.5,
                     label="one round (interleaved pair)" if x == 0 else None)
        median = summary[f"b{b}"]["ratio_median"]
        ax_tpot.plot([x - 0.2, x + 0.2], [median, median], color="tab:orange", lw=3,
                     label="median of rounds" if x == 0 else None)
        ax_tpot.annotate(f"{median:.2f}x", (x + 0.22, median), va="center")
    ax_tpot.axhline(1.0, color="grey", lw=0.8)
    ax_tpot.axhline(0.9, color="tab:red", lw=0.8, ls="--", label="target 0.9x")
    ax_tpot.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax_tpot.set_xlim(-0.6, len(batches) - 0.4)
    ax_tpot.set_ylabel("plain TPOT / json_schema TPOT (1.0 = free)")
    ax_tpot.set_title("json_schema stream speed relative to plain, over HTTP")
    ax_tpot.legend(loc="upper center", fontsize=8)
    kinds = [k for k in results["compile"] if isinstance(results["compile"][k], dict)]
    ax_compile.bar(kinds, [results["compile"][k]["compile_ms_median"] for k in kinds], color="tab:green")
    ax_compile.set_ylabel("compile time (ms, median of new grammars)")
    ax_compile.set_title("compile of a new grammar (then cached)")
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
    ap.add_argument("--parts", default="compile,tpot", help="any of compile,tpot")
    ap.add_argument("--json", help="write the figures here (parts not measured are kept from an existing file)")
    ap.add_argument("--plot", help="write a PNG here")
    args = ap.parse_args(argv)

    parts = args.parts.split(",")
    results: dict[str, Any] = {}
    if args.json and Path(args.json).is_file():
        results = json.loads(Path(args.json).read_text())
    results.setdefault("settings", {})
    results["model"] = args.model
    from bench.report import git_revision, machine_info

    # NOTE(bench): each part records the revision and machine it was measured on (parts may come from two runs)
    where = {"git": git_revision(), "machine": machine_info()}
    if "compile" in parts:
        from engine.builder import resolve_model

        results["compile"] = measure_compile(Path(resolve_model(args.model)), args)
        results["settings"]["compile"] = {"compile_variants": args.compile_variants, **where}
    if "tpot" in parts:
        server = None
        url = args.url
        if url is None:
            port = free_port()
            server = start_server(args.model, port, args.threads, "--max-batch", str(max(8, *args.batches)),
                                  ready_timeout_s=600)  # a first run pulls and converts the model
            url = f"http://127.0.0.1:{port}/v1"
        try:
            results["tpot"] = asyncio.run(measure_tpot(url, args))
            results["settings"]["tpot"] = {k: v for k, v in vars(args).items()
                                           if k in ("url", "threads", "rounds", "batches", "prompt_tokens",
                                                    "output_tokens")} | where
        finally:
            if server is not None:
                server.terminate()
                server.wait(30)
    for batch, s in results.get("tpot", {}).get("summary", {}).items():
        print(f"{batch}: plain {s['plain_tpot_ms_median']:.2f} ms/token, json_schema "
              f"{s['json_schema_tpot_ms_median']:.2f} ms/token; ratio median {s['ratio_median']:.3f} "
              f"(rounds {[round(r, 3) for r in s['ratios']]})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot and "tpot" in results and "compile" in results:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
