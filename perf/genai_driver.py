"""onnxruntime-genai single-stream driver: the same prompts and the same JSON report as the HTTP bench.

`python -m perf.genai_driver --model-dir DIR --out genai.json`. Imports onnxruntime_genai (a test/dev
dependency) only; no server or engine import.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.loadgen import RunResult
from bench.metrics import RequestRecord, Slo
from bench.report import build_report, format_summary, run_entry, write_report
from bench.scenarios import iter_requests


class GenaiRunner:
    """One onnxruntime-genai model, generating one request at a time (its Generator is single-stream here).

    NOTE(bench): timing mirrors the HTTP client: the clock starts before tokenization, TTFT is taken when
    the first token that decodes to text is ready, and each later token with text adds an inter-token gap.
    EOS is held off with search option min_length = prompt + max_tokens (the same "ignore_eos" the HTTP
    bench asks for), so every request produces exactly max_tokens tokens.
    """

    def __init__(self, model_dir: str, *, threads: int | None = None, endpoint: str = "chat") -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(model_dir)
        if threads is not None:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)
        self.tokenizer = og.Tokenizer(self.model)
        self.endpoint = endpoint

    def generate(self, prompt: str, max_tokens: int, record: RequestRecord) -> None:
        og = self.og
        t_send = time.perf_counter()
        try:
            if self.endpoint == "chat":
                prompt = self.tokenizer.apply_chat_template(json.dumps([{"role": "user", "content": prompt}]),
                                                            add_generation_prompt=True)
            prompt_ids = self.tokenizer.encode(prompt)
            length = len(prompt_ids) + max_tokens
            params = og.GeneratorParams(self.model)
            params.set_search_options(max_length=length, min_length=length, do_sample=False)
            generator = og.Generator(self.model, params)
            stream = self.tokenizer.create_stream()
            generator.append_tokens(prompt_ids)
            record.usage_prompt_tokens = len(prompt_ids)
            num_tokens = 0
            while not generator.is_done():
                generator.generate_next_token()
                text = stream.decode(int(generator.get_next_tokens()[0]))
                now = time.perf_counter()
                num_tokens += 1
                if text:
                    record.add_content_chunk(now - t_send)
            record.usage_completion_tokens = num_tokens
            record.finish_reason = "length"
        except Exception as exc:  # noqa: BLE001 - recorded like a server error
            record.error_kind, record.error = "other", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            record.e2e_s = time.perf_counter() - t_send


def run(runner: GenaiRunner, num_requests: int, prompt_tokens: int, output_tokens: int, *, seed: int = 0,
        duration_s: float | None = None) -> RunResult:
    """Serve the bench's "fixed" scenario one request after another (concurrency 1)."""
    records = []
    t0 = time.perf_counter()
    for spec in iter_requests("fixed", num_requests, prompt_tokens, output_tokens, seed=seed):
        if duration_s is not None and time.perf_counter() - t0 > duration_s:
            break
        record = RequestRecord(index=spec.index, start_s=time.perf_counter() - t0,
                               num_prompt_tokens_target=spec.num_prompt_tokens_target, max_tokens=spec.max_tokens)
        runner.generate(spec.prompt, spec.max_tokens, record)
        records.append(record)
    return RunResult(records=records, duration_s=time.perf_counter() - t0, num_not_sent=num_requests - len(records))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.genai_driver",
                                description="Single-stream onnxruntime-genai figures in the bench's JSON format.")
    p.add_argument("--model-dir", required=True, help="ONNX Runtime GenAI model folder")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="chat: apply the model's chat template to the prompt, as /chat/completions does")
    p.add_argument("--threads", type=int, help="ORT intra-op threads (default: the folder's genai_config)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--duration", type=float, default=600.0, help="stop starting requests after this many s")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (the bench uses seed*1000 + level index)")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--label", default="onnxruntime-genai")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    runner = GenaiRunner(args.model_dir, threads=args.threads, endpoint=args.endpoint)
    if args.warmup > 0:
        run(runner, args.warmup, args.prompt_tokens, args.output_tokens, seed=10**6 + args.seed)
    result = run(runner, args.num_requests, args.prompt_tokens, args.output_tokens, seed=args.seed * 1000,
                 duration_s=args.duration)
    entry = run_entry(result, slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms), concurrency=1,
                      extra={"scenario": "fixed"})
    settings = {k: v for k, v in vars(args).items()}
    settings.update(mode="onnxruntime-genai", model=args.model_dir, concurrency=[1])
    report = build_report(args.label, settings, [entry])
    print(format_summary(entry))
    print(f"report: {write_report(report, args.out)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
