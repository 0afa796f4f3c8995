"""`ortserve bench` / `python -m bench`: parse flags, run each load level, write the report and plots.

Wires loadgen, scenarios, metrics, report and plots; imports the engine only for --engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable

from bench.loadgen import (HttpBackend, HttpSettings, RemoteUrlError, RssSampler, check_loopback, run_load,
                           run_load_processes)
from bench.metrics import Slo
from bench.report import (
    build_report, compare, format_compare, format_summary, git_revision, load_report, machine_info, run_entry,
    write_report,
)
from bench.features import FEATURE_SCENARIOS
from bench.decisions import DECISIONS_SCENARIO
from bench.embeddings import EMBEDDINGS_SCENARIO
from bench.sizes import SIZES_SCENARIO
from bench.scenarios import SCENARIOS, iter_requests
from bench.speculative import SPECULATIVE_SCENARIO, WORKLOADS

DEFAULT_URL = "http://127.0.0.1:8000/v1"
SOAK_BASELINE_REQUESTS = 1000  # issue 8: RSS after the first 1,000 requests vs at the end


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected rates > 0, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ortserve bench",
        description="Load-test an OpenAI-compatible server (or the engine in-process) over the streaming API "
        "and report TTFT, inter-token latency, throughput and goodput.")
    target = p.add_argument_group("target")
    target.add_argument("--url", default=DEFAULT_URL, help="OpenAI base URL (default %(default)s)")
    target.add_argument("--model", help="model id (default: the first of GET /models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                        help="bearer token (default: $OPENAI_API_KEY or 'EMPTY')")
    target.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="chat: /chat/completions with one user message; completions: /completions")
    target.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    target.add_argument("--engine", metavar="MODEL_DIR",
                        help="engine-direct mode: drive AsyncEngine in-process on this model folder, no HTTP")
    target.add_argument("--engine-max-batch", type=_positive_int,
                        help="engine-direct KV slots (default: max(8, the largest concurrency))")
    target.add_argument("--engine-provider", default="cpu", help="engine-direct execution provider (default cpu)")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=_int_list, default=None,
                      help="closed-loop users, comma-separated, one run per level (default 1; embeddings 1,8,32)")
    load.add_argument("--rate", type=_float_list,
                      help="open loop instead: Poisson arrival rates in req/s, comma-separated, one run each")
    load.add_argument("--num-requests", type=_positive_int,
                      help="requests per run (default 32; multiturn: conversations, default 6; copy: 8)")
    load.add_argument("--prompt-tokens", type=_positive_int, default=128, help="prompt length (default 128)")
    load.add_argument("--output-tokens", type=_positive_int,
                      help="output tokens per request, sent as max_tokens (default 128; multiturn 32; copy 256)")
    load.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                      help="do not send ignore_eos/min_tokens (requests may stop early at EOS)")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    load.add_argument("--extra-body", type=json.loads, default={},
                      help="JSON object merged into every request body")
    load.add_argument("--scenario", default="fixed",
                      choices=SCENARIOS + FEATURE_SCENARIOS + (EMBEDDINGS_SCENARIO, DECISIONS_SCENARIO, SIZES_SCENARIO,
                                                               SPECULATIVE_SCENARIO),
                      help="fixed lengths; soak: mixed prompt/output lengths + server RSS sampling; json_schema: "
                      "fixed lengths, every answer constrained by response_format to a typical JSON schema; "
                      "multiturn: growing conversations over a long system prompt (prefix reuse); copy: answers "
                      "that repeat their input, beside free text (speculative decoding); embeddings: texts/s "
                      "through /v1/embeddings at each --concurrency and --batch-sizes, beside --peer-url servers; "
                      "decisions: 1, 5 and 20 questions over a ~1,000-token input, decisions/s at each "
                      "--concurrency, rerank of 8 and 32 documents (--rounds rounds); sizes: ortserve against "
                      "llama-server on one --gguf (conversion, load, KV per token, decode at 1 and --slots streams, "
                      "TTFT of a --ttft-prompt-tokens prompt), both started here, one at a time; speculative: code "
                      "edit, free chat and JSON at each --temperatures and --concurrency, tok/s and draft acceptance "
                      "by position against --peer-url servers (drafts off, llama-server with and without -md)")
    load.add_argument("--duration", type=float, default=600.0,
                      help="hard cap per run in seconds; in-flight requests are cut (default %(default)s)")
    load.add_argument("--request-timeout", type=float, default=300.0,
                      help="cap on one request in seconds (default %(default)s)")
    load.add_argument("--client-processes", type=_positive_int, default=1,
                      help="split each closed-loop level's users over this many client processes (HTTP, fixed "
                      "scenario): one process streams ~4,000 chunks/s before the bench, not the server, is the "
                      "limit (default 1)")
    load.add_argument("--warmup", type=int, default=1, help="unrecorded requests before the first run (default 1)")
    load.add_argument("--seed", type=int, default=0, help="prompt and arrival seed (default 0)")
    feat = p.add_argument_group("multiturn and copy scenarios")
    feat.add_argument("--peer-url", action="append", metavar="URL",
                      help="a server to interleave every request with (repeatable), e.g. the same server with "
                      "--no-prefix-caching or --speculative-tokens 0: ratios against it")
    feat.add_argument("--peer-label", action="append", metavar="NAME", help="name of each --peer-url in reports")
    feat.add_argument("--distinct-prompts", action="store_true",
                      help="multiturn: every target gets its own system prompts (for peers that front the same "
                      "servers, e.g. two routers over one set of replicas)")
    feat.add_argument("--turns", type=_positive_int, default=6, help="multiturn: turns per conversation (default 6)")
    feat.add_argument("--system-tokens", type=_positive_int, default=1000,
                      help="multiturn: system prompt length in tokens (default 1000)")
    feat.add_argument("--user-tokens", type=_positive_int, default=40,
                      help="multiturn: user message length in tokens (default 40)")
    feat.add_argument("--pause", type=float, default=0.2,
                      help="multiturn/copy: seconds between requests, so a server's spinning threads go idle "
                      "before the next one runs (default 0.2)")
    spec = p.add_argument_group("speculative scenario")
    spec.add_argument("--workloads", type=lambda v: v.split(","), default=list(WORKLOADS),
                      help=f"comma-separated, of {','.join(WORKLOADS)} (default all)")
    spec.add_argument("--temperatures", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 0.7],
                      help="comma-separated (default 0,0.7)")
    emb = p.add_argument_group("embeddings and decisions scenarios")
    emb.add_argument("--batch-sizes", type=_int_list, default=[1, 32],
                     help="texts per /v1/embeddings request, comma-separated (default 1,32)")
    emb.add_argument("--input-words", type=_positive_int, default=880,
                     help="decisions: words of the long input the 1, 5 and 20 questions share (default 880, about "
                     "1,000 tokens)")
    emb.add_argument("--rounds", type=_positive_int, default=3,
                     help="rounds; each runs every level on every target in turn (default 3)")
    sz = p.add_argument_group("sizes scenario")
    sz.add_argument("--gguf", help="sizes: the GGUF both servers serve (ortserve converts it, timed)")
    sz.add_argument("--llama-server", help="sizes: the llama-server binary to compare with")
    sz.add_argument("--model-dir", help="sizes: the GGUF already converted (skips the timed conversion)")
    sz.add_argument("--convert-arg", action="append", default=[], metavar="ARG",
                    help="sizes: an `ortserve convert` flag (repeatable), e.g. --convert-arg=--kv-dtype "
                    "--convert-arg=float16")
    sz.add_argument("--ours-arg", action="append", default=[], metavar="ARG",
                    help="sizes: an `ortserve serve` flag (repeatable)")
    sz.add_argument("--peer-arg", action="append", default=[], metavar="ARG",
                    help="sizes: a llama-server flag (repeatable), e.g. --peer-arg=--poll --peer-arg=0")
    sz.add_argument("--threads", type=_positive_int, default=2, help="sizes: threads of each server (default 2)")
    sz.add_argument("--slots", type=_positive_int, default=2, help="sizes: slots and streams (default 2)")
    sz.add_argument("--context", type=_positive_int, default=4096, help="sizes: tokens per slot (default 4096)")
    sz.add_argument("--ttft-prompt-tokens", type=int, default=2000,
                    help="sizes: the long prompt whose TTFT is measured (default 2000; 0: none)")
    sz.add_argument("--work-dir", default="bench/results/sizes-work",
                    help="sizes: the converted folder and the servers' logs (default %(default)s; outside git)")
    sz.add_argument("--port", type=_positive_int, default=18461, help="sizes: ortserve's port; llama-server's is the next")
    slo = p.add_argument_group("goodput")
    slo.add_argument("--slo-ttft-ms", type=float, help="TTFT bound for goodput")
    slo.add_argument("--slo-tpot-ms", type=float, help="time-per-output-token bound for goodput")
    mem = p.add_argument_group("server memory")
    mem.add_argument("--server-pid", type=int, help="sample this process's RSS during the runs")
    mem.add_argument("--rss-interval", type=float, default=1.0, help="RSS sampling period in s (default 1)")
    out = p.add_argument_group("output")
    out.add_argument("--out", help="write the JSON report here")
    out.add_argument("--plot", help="write a PNG plot here")
    out.add_argument("--label", help="name of this server in reports and comparisons (default: the model id "
                     "or 'engine-direct')")
    out.add_argument("--compare", nargs="+", metavar="REPORT",
                     help="compare saved reports (ratios to the first); with --plot draws them together")
    out.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="force the live progress line (default: when stderr is a terminal)")
    out.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ortserve bench` and `python -m bench`.

    Returns:
        0 when every run finished (errors from the server are figures, not failures); 1 when the target
        could not be used (remote URL refused, server unreachable, bad reports); argparse exits with 2.
    """
    args = build_parser().parse_args(argv)
    if args.compare:
        return _compare(args)
    if args.scenario == EMBEDDINGS_SCENARIO:
        args.concurrency = args.concurrency or [1, 8, 32]
        return _embeddings(args)
    if args.scenario == SPECULATIVE_SCENARIO:
        from bench import speculative

        return _http_scenario(args, "the speculative scenario runs", speculative.run,
                              lambda report, names: speculative.format_summary(report), speculative.plot)
    if args.scenario == DECISIONS_SCENARIO:
        args.concurrency = args.concurrency or [1, 4]
        return _decisions(args)
    if args.scenario == SIZES_SCENARIO:
        return _sizes(args)
    args.concurrency = args.concurrency or [1]
    if args.scenario in FEATURE_SCENARIOS:
        # copy: room for the longest passage (the model ends with EOS once it has copied it)
        args.output_tokens = args.output_tokens or (32 if args.scenario == "multiturn" else 256)
        return _features(args)
    args.num_requests = args.num_requests or 32
    args.output_tokens = args.output_tokens or 128
    if args.engine is None:
        try:
            check_loopback(args.url, args.allow_remote)
        except RemoteUrlError as exc:
            print(f"ortserve bench: {exc}", file=sys.stderr)
            return 1
    try:
        report = asyncio.run(_run(args))
    except _TargetError as exc:
        print(f"ortserve bench: {exc}", file=sys.stderr)
        return 1
    for run in report["runs"]:
        print(format_summary(run))
    if args.out:
        print(f"report: {write_report(report, args.out)}")
    if args.plot:
        from bench.plots import plot_report

        print(f"plot: {plot_report(report, args.plot)}")
    return 0


def _features(args: argparse.Namespace) -> int:
    """The multiturn and copy scenarios (bench/features.py), HTTP only."""
    from bench import features

    def plot(report: dict, path: str) -> object:
        from bench.plots import plot_features

        return plot_features([report], path)
    return _http_scenario(args, "the multiturn and copy scenarios run", features.run,
                          lambda report, names: features.format_summary(args.scenario, report["summary"], names), plot)


def _embeddings(args: argparse.Namespace) -> int:
    """The embeddings scenario (bench/embeddings.py), HTTP only."""
    from bench import embeddings

    return _http_scenario(args, "the embeddings scenario runs", embeddings.run,
                          lambda report, names: embeddings.format_summary(report["summary"], names), embeddings.plot)


def _decisions(args: argparse.Namespace) -> int:
    """The decisions scenario (bench/decisions.py), HTTP only."""
    from bench import decisions

    return _http_scenario(args, "the decisions scenario runs", decisions.run,
                          lambda report, names: decisions.format_summary(report["summary"], names), decisions.plot)


def _sizes(args: argparse.Namespace) -> int:
    """The sizes scenario (bench/sizes.py): starts both servers itself."""
    from pathlib import Path

    from bench import sizes

    if not args.gguf or not args.llama_server:
        print("ortserve bench: --scenario sizes needs --gguf and --llama-server", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    settings = sizes.SizesSettings(
        gguf=Path(args.gguf), llama_server=Path(args.llama_server),
        model_dir=Path(args.model_dir) if args.model_dir else None, convert_args=tuple(args.convert_arg),
        ours_args=tuple(args.ours_arg), peer_args=tuple(args.peer_arg),
        threads=args.threads, slots=args.slots, context=args.context, rounds=args.rounds,
        output_tokens=args.output_tokens or 32, ttft_prompt_tokens=args.ttft_prompt_tokens, seed=args.seed,
        port=args.port, work_dir=Path(args.work_dir))
    try:
        report = sizes.run(settings)
    except (OSError, RuntimeError) as exc:
        print(f"ortserve bench: {exc}", file=sys.stderr)
        return 1
    report["git"], report["machine"] = git_revision(), machine_info()
    print(sizes.format_summary(report))
    if out:
        print(f"report: {write_report(report, out)}")
    if args.plot:
        print(f"plot: {sizes.plot(report, args.plot)}")
    return 0


def _http_scenario(args: argparse.Namespace, what: str, run: Callable, summary: Callable, plot: Callable) -> int:
    """Run an HTTP-only scenario against the loopback targets: its summary, report and plot (exit status)."""
    if args.engine is not None:
        print(f"ortserve bench: {what} over HTTP (drop --engine)", file=sys.stderr)
        return 1
    try:
        for url in [args.url, *(args.peer_url or [])]:
            check_loopback(url, args.allow_remote)
    except RemoteUrlError as exc:
        print(f"ortserve bench: {exc}", file=sys.stderr)
        return 1
    try:
        report = asyncio.run(run(args))
    except Exception as exc:  # noqa: BLE001 - unreachable server, no model: one line
        print(f"ortserve bench: cannot use the target: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(summary(report, [t.get("name", t.get("label")) for t in report["targets"]]))
    if args.out:
        print(f"report: {write_report(report, args.out)}")
    if args.plot:
        print(f"plot: {plot(report, args.plot)}")
    return 0


class _TargetError(RuntimeError):
    """The server or engine could not be reached or loaded at all."""


async def _run(args: argparse.Namespace) -> dict:
    levels: list[dict] = ([{"rate_per_s": r} for r in args.rate] if args.rate
                          else [{"concurrency": c} for c in args.concurrency])
    if args.engine is not None:
        from bench.engine_driver import EngineBackend
        from engine.config import EngineConfig

        max_batch = args.engine_max_batch or min(256, max([8, *args.concurrency]))
        # (the step budget is the device profile's, as in a server: 256, 512 on WebGPU, at least max_batch + 1)
        config = EngineConfig(provider=args.engine_provider, max_batch=max_batch, max_queue=max(64, args.num_requests))
        backend = EngineBackend(args.engine, endpoint=args.endpoint, temperature=args.temperature,
                                ignore_eos=args.ignore_eos, engine_config=config)
        server_pid: int | None = os.getpid()
    else:
        max_users = max(args.concurrency) if not args.rate else 1024
        backend = HttpBackend(HttpSettings(url=args.url, model=args.model, api_key=args.api_key,
                                           endpoint=args.endpoint, temperature=args.temperature,
                                           ignore_eos=args.ignore_eos, extra_body=args.extra_body,
                                           request_timeout_s=args.request_timeout),
                              max_connections=max(16, max_users))
        server_pid = args.server_pid
    slo = Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    runs = []
    try:
        try:
            await backend.prepare()
        except Exception as exc:  # noqa: BLE001 - reported as one line, whatever the class
            raise _TargetError(f"cannot use the target: {type(exc).__name__}: {exc}") from exc
        await _warmup(backend, args)
        for i, level in enumerate(levels):
            specs = iter_requests(args.scenario, args.num_requests, args.prompt_tokens, args.output_tokens,
                                  seed=args.seed * 1000 + i)
            sampler = None
            if server_pid is not None:
                sampler = RssSampler(server_pid, interval_s=args.rss_interval,
                                     baseline_after=min(SOAK_BASELINE_REQUESTS, max(1, args.num_requests // 10)))
            label = f"{'c' if 'concurrency' in level else 'rate'}={next(iter(level.values()))}"
            if args.client_processes > 1 and args.engine is None and "concurrency" in level:
                if args.scenario != "fixed":
                    raise _TargetError("--client-processes splits the fixed scenario only")
                result = await asyncio.to_thread(
                    run_load_processes, backend.settings, args.scenario, args.num_requests, args.prompt_tokens,
                    args.output_tokens, processes=args.client_processes, concurrency=level["concurrency"],
                    seed=args.seed * 1000 + i, duration_s=args.duration, max_connections=max(16, max_users))
            else:
                result = await run_load(backend, specs, args.num_requests, duration_s=args.duration,
                                        seed=args.seed * 1000 + i, label=label, progress=args.progress,
                                        rss_sampler=sampler, **level)
            runs.append(run_entry(result, slo=slo, extra={"scenario": args.scenario}, **level))
    finally:
        await backend.aclose()
    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "compare", "progress")}
    settings["model"] = backend.model
    settings["mode"] = "engine-direct" if args.engine else "http"
    label = args.label or ("engine-direct" if args.engine else backend.model or "server")
    return build_report(label, settings, runs)


async def _warmup(backend, args: argparse.Namespace) -> None:
    """Send --warmup requests one by one, unrecorded; fail fast if the server is unreachable."""
    if args.warmup <= 0:
        return
    # NOTE(bench): the json_schema scenario warms up with its own schema, so its compile (and the grammar
    # tokenizer's one-time build) is not in the first recorded request.
    scenario = "json_schema" if args.scenario == "json_schema" else "fixed"
    result = await run_load(backend, iter_requests(scenario, args.warmup, args.prompt_tokens, args.output_tokens,
                                                   seed=10**6 + args.seed),
                            args.warmup, concurrency=1, duration_s=args.duration, label="warmup",
                            progress=args.progress)
    kinds = {r.error_kind for r in result.records}
    if kinds == {"connection"}:
        raise _TargetError(f"warm-up could not connect: {result.records[0].error}")


def _compare(args: argparse.Namespace) -> int:
    try:
        reports = [load_report(path) for path in args.compare]
    except (OSError, ValueError) as exc:
        print(f"ortserve bench: {exc}", file=sys.stderr)
        return 1
    print(format_compare(compare(reports)), end="")
    if args.plot:
        from bench.plots import plot_compare

        print(f"plot: {plot_compare(reports, args.plot)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
