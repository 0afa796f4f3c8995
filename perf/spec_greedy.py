"""Issue 48's greedy check through HTTP: every prompt of bench/speculative.py's workloads, asked of one ortserve serving
the target with its draft model, once with drafts (the draft model and prompt lookup) and once without
(``"speculative": false``), temperature 0, top-5 logprobs; the two answers compared by the test suite's near-tie rule
(tests/greedy_close.py: equal, or parting only where the reference's top two are within MAX_GAP_NATS).

NOTE(perf): the reported log-probabilities are the model's, before penalties (as vLLM's by default), and the model's
generation_config asks for repetition_penalty 1.1: a choice the penalty made is then no near-tie by the numbers
reported, though both sides made it the same way. So the check runs with ``--repetition-penalty 1.0`` by default
(the argmax of what is reported); pass 1.1 to see the served defaults' texts.

    ORTSERVE_CACHE_DIR=.cache flock /work/locks/cpu-bench.lock .venv/bin/python -m perf.spec_greedy \\
        --out docs/perf/spec-greedy-cpu.json

Writes a JSON report (git SHA, every pair's first divergence and the draft counters of each answer).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _spec_counters(base: str) -> dict[str, float]:
    """The server's draft tokens and accepted tokens so far (vLLM's spec_decode counters, summed over models)."""
    from tests.integration.server.conftest import metrics_samples

    samples = metrics_samples(httpx.get(f"{base}/metrics", timeout=30).text)
    return {kind: sum(v for k, v in samples.items() if k.split("{")[0] == f"vllm:spec_decode_num_{kind}_total")
            for kind in ("draft_tokens", "accepted_tokens")}


def main() -> None:
    from bench.speculative import CHAT, CODE_CHANGES, JSON_ASKS, messages_of
    from perf.batch_priority import _free_port
    from tests.greedy_close import MAX_GAP_NATS, GreedyRun, first_divergence
    from tests.integration.server.conftest import wait_healthy

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=ROOT / "docs/perf/spec-greedy-cpu.json")
    args = p.parse_args()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "server", "serve", "--model", args.target, "--draft-model",
                               args.draft, "--port", str(port), "--provider", "cpu", "--log-level", "warning"],
                              cwd=ROOT, stdout=subprocess.DEVNULL)
    pairs: list[dict[str, Any]] = []
    try:
        wait_healthy(base, lambda: server.poll() is None, 600, poll_s=0.5)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=900)
        counts = {"code_edit": len(CODE_CHANGES), "chat": len(CHAT), "json": len(JSON_ASKS)}
        for workload, num in counts.items():
            for i in range(num):
                runs = {}
                for label, extra in (("drafts", {}), ("off", {"speculative": False})):
                    before = _spec_counters(base)
                    r = client.chat.completions.create(model=args.target, messages=messages_of(workload, i),
                                                       max_tokens=args.max_tokens, temperature=0, logprobs=True,
                                                       top_logprobs=5,
                                                       extra_body={**extra, "repetition_penalty": args.repetition_penalty})
                    after = _spec_counters(base)
                    choice = r.choices[0]
                    runs[label] = (GreedyRun.from_openai(choice.logprobs, choice.finish_reason),
                                   {k: after[k] - before.get(k, 0.0) for k in after})
                d = first_divergence(runs["off"][0], runs["drafts"][0])
                pair = {"workload": workload, "prompt": i, "tokens": len(runs["off"][0].tokens),
                        "drafted": runs["drafts"][1], "equal": d is None,
                        "near_tie": d is not None and d.is_near_tie(MAX_GAP_NATS),
                        "divergence": None if d is None else d.describe(runs["off"][0], runs["drafts"][0])}
                pairs.append(pair)
                print(json.dumps(pair), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    summary = {"pairs": len(pairs), "equal": sum(p["equal"] for p in pairs),
               "near_tie": sum(p["near_tie"] for p in pairs),
               "differ": sum(not p["equal"] and not p["near_tie"] for p in pairs)}
    args.out.write_text(json.dumps({"git_sha": sha, "target": args.target, "draft": args.draft,
                                    "max_tokens": args.max_tokens, "repetition_penalty": args.repetition_penalty, "summary": summary, "pairs": pairs}, indent=1))
    print("summary:", json.dumps(summary))


if __name__ == "__main__":
    main()
