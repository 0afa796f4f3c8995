"""Issue 47's batch figures, through HTTP as users see them, on one real `ortserve serve` (the default model, CPU):

1. idle: interactive TTFT (one streamed chat request at a time), and an 8-stream bench's output tok/s (its
   requests are the batch lines' own bodies, logprobs included: the ratio compares the same work);
2. a 1,000-line chat batch (POST /v1/files, /v1/batches), with the same interactive requests sent one after
   another while it runs: their TTFT, and the batch's own output tok/s (its lines' completion tokens over the
   time from in_progress to the last line);
3. idle again (the two idle rounds bracket the batch, so a change of the machine's background load shows);
4. every line's output against the same request run alone (greedy, logprobs), by the suite's near-tie rule;
5. optionally (--kill), a second 1,000-line batch killed with SIGKILL midway, the server started again on the same
   state file: the batch completes with 1,000 outputs, none duplicated.

Ratios, not absolute times: TTFT p50 during the batch over idle, and the batch's tok/s over the 8-stream bench's.
Writes a JSON report (git SHA, settings, every sample) and a plot. Run it alone on the machine:

    flock /work/locks/cpu-bench.lock .venv/bin/python -m perf.batch_priority --out docs/perf/batch-priority.json
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m-instruct"
MAX_BATCH = 8  # the server's default --max-batch (its rows)
INTERACTIVE = [{"role": "user", "content": "Write a haiku about the sea."}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m server serve` on a free port; stopped (or killed) by the caller."""

    def __init__(self, model: str, state: Path, args: list[str]) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--model", model, "--port",
                                      str(self.port), "--provider", "cpu", "--state-url", str(state),
                                      "--log-level", "warning", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=self.log)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"server did not start: {self.log.read()[-2000:]}")
            time.sleep(0.2)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=600)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=600)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)


async def ttft_s(client: openai.AsyncOpenAI, max_tokens: int) -> float:
    """One streamed interactive chat request: seconds to its first content."""
    start = time.perf_counter()
    stream = await client.chat.completions.create(model=MODEL, messages=INTERACTIVE, max_tokens=max_tokens,
                                                  temperature=0, stream=True)
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


async def idle_round(server: Server, num_ttft: int, num_stream_requests: int, max_tokens: int) -> dict[str, Any]:
    """Idle TTFT samples, then 8 streams of batch-like requests (their output tok/s)."""
    client = server.async_client()
    ttfts = [await ttft_s(client, 8) for _ in range(num_ttft)]
    queue = list(range(num_stream_requests))
    tokens = 0

    async def stream_worker() -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            body = line_body(i, max_tokens)
            extra = {"ignore_eos": body.pop("ignore_eos")}
            r = await client.chat.completions.create(**body, extra_body=extra)
            tokens += r.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(stream_worker() for _ in range(8)))
    elapsed = time.perf_counter() - start
    await client.close()
    return {"ttft_s": ttfts, "streams8_tokens": tokens, "streams8_s": elapsed, "streams8_tok_s": tokens / elapsed}


def line_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give a one-line fact about the number {i}."}]


def line_body(i: int, max_tokens: int) -> dict[str, Any]:
    """Batch line ``i``'s request body (the 8-stream bench sends the same ones)."""
    return {"model": MODEL, "messages": line_messages(i), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 5}


def batch_lines(n: int, max_tokens: int) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": line_body(i, max_tokens)}) for i in range(n)).encode()


async def batch_round(server: Server, num_lines: int, max_tokens: int) -> dict[str, Any]:
    """The batch, with interactive requests one after another while it runs."""
    client = server.client()
    upload = client.files.create(file=("lines.jsonl", io.BytesIO(batch_lines(num_lines, max_tokens))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 2 * MAX_BATCH:
        await asyncio.sleep(0.1)  # the batch fills the rows before the first interactive request
    aclient = server.async_client()
    ttfts: list[float] = []
    while (b := client.batches.retrieve(batch.id)).status == "in_progress" and \
            b.request_counts.completed < num_lines * 0.9:
        ttfts.append(await ttft_s(aclient, 8))
        await asyncio.sleep(0.2)
    while (b := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        await asyncio.sleep(0.5)
    await aclient.close()
    outputs = [json.loads(line) for line in client.files.content(b.output_file_id).text.splitlines()]
    tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs)
    elapsed = (b.finalizing_at or b.completed_at) - b.in_progress_at
    return {"batch_id": b.id, "status": b.status, "counts": b.request_counts.model_dump(), "ttft_s": ttfts,
            "batch_tokens": tokens, "batch_s": elapsed, "batch_tok_s": tokens / max(elapsed, 1e-9),
            "outputs": outputs}


def compare_alone(server: Server, outputs: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """Each line's answer against the same request alone, by tests/greedy_close.py's rule."""
    from tests.greedy_close import MAX_GAP_NATS, GreedyRun, first_divergence

    client = server.client()
    exact = near = far = 0
    worst = []
    for out in outputs:
        i = int(out["custom_id"].split("-")[1])
        alone = client.chat.completions.create(model=MODEL, messages=line_messages(i), max_tokens=max_tokens,
                                               temperature=0, extra_body={"ignore_eos": True}, logprobs=True,
                                               top_logprobs=5).choices[0]
        choice = out["response"]["body"]["choices"][0]
        ref = GreedyRun.from_openai(alone.logprobs, alone.finish_reason)
        got = GreedyRun.from_openai(choice["logprobs"], choice["finish_reason"])
        d = first_divergence(ref, got)
        if d is None:
            exact += 1
        elif d.is_near_tie(MAX_GAP_NATS):  # the suite's bound (tests/greedy_close.py)
            near += 1
        else:
            far += 1
            worst.append({"custom_id": out["custom_id"], "divergence": d.describe(ref, got)})
    return {"exact": exact, "near_tie": near, "differ": far, "differences": worst[:20]}


def kill_run(model: str, state: Path, num_lines: int, max_tokens: int, server_args: list[str]) -> dict[str, Any]:
    """A batch killed with SIGKILL at about 40%, then finished by a restarted server on the same state file."""
    server = Server(model, state, server_args)
    client = server.client()
    upload = client.files.create(file=("lines.jsonl", io.BytesIO(batch_lines(num_lines, max_tokens))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < num_lines * 0.4:
        time.sleep(0.2)
    before = client.batches.retrieve(batch.id).request_counts.completed
    server.stop(signal.SIGKILL)
    server = Server(model, state, server_args)
    client = server.client()
    while (b := client.batches.retrieve(batch.id)).status != "completed":
        time.sleep(0.5)
    outputs = [json.loads(line)["custom_id"] for line in client.files.content(b.output_file_id).text.splitlines()]
    server.stop()
    return {"completed_before_kill": before, "outputs": len(outputs), "distinct": len(set(outputs)),
            "counts": b.request_counts.model_dump()}


def summary(report: dict[str, Any]) -> dict[str, Any]:
    idle_ttft = report["idle_before"]["ttft_s"] + report["idle_after"]["ttft_s"]
    streams = [report["idle_before"]["streams8_tok_s"], report["idle_after"]["streams8_tok_s"]]
    p50_idle = statistics.median(idle_ttft)
    p50_batch = statistics.median(report["batch"]["ttft_s"])
    return {"ttft_p50_idle_ms": p50_idle * 1e3, "ttft_p50_during_batch_ms": p50_batch * 1e3,
            "ttft_ratio": p50_batch / p50_idle, "streams8_tok_s": statistics.mean(streams),
            "batch_tok_s": report["batch"]["batch_tok_s"],
            "batch_over_streams8": report["batch"]["batch_tok_s"] / statistics.mean(streams)}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    samples = [[t * 1e3 for t in report["idle_before"]["ttft_s"] + report["idle_after"]["ttft_s"]],
               [t * 1e3 for t in report["batch"]["ttft_s"]]]
    left.boxplot(samples, tick_labels=["idle", "during the batch"])
    left.set_ylabel("interactive TTFT (ms)")
    left.set_title(f"TTFT p50 ratio {s['ttft_ratio']:.2f}x")
    right.bar(["8-stream bench", "batch lines"], [s["streams8_tok_s"], s["batch_tok_s"]])
    right.set_ylabel("output tokens/s")
    right.set_title(f"batch / 8 streams = {s['batch_over_streams8']:.0%}")
    fig.suptitle(f"{report['num_lines']}-line batch, {report['max_tokens']} tokens per line, default model, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ttft-samples", type=int, default=15, help="interactive requests per idle round")
    parser.add_argument("--stream-requests", type=int, default=64, help="requests of the 8-stream bench per round")
    parser.add_argument("--no-compare", action="store_true", help="skip the comparison with each request alone")
    parser.add_argument("--kill", action="store_true", help="also the SIGKILL-and-restart run")
    parser.add_argument("--server-args", default="", help="more `ortserve serve` flags, e.g. '--engine-process'")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/perf/batch-priority.json")
    args = parser.parse_args()
    from engine.builder import pull_model

    model = str(pull_model(progress=False))
    work = Path(tempfile.mkdtemp(prefix="batch-priority-"))
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report: dict[str, Any] = {"git_sha": sha, "num_lines": args.lines, "max_tokens": args.max_tokens,
                              "model": MODEL, "cpu_count": os.cpu_count(), "load_before": os.getloadavg()[0]}
    server_args = args.server_args.split()
    report["server_args"] = server_args
    server = Server(model, work / "state.db", server_args)
    try:
        report["idle_before"] = asyncio.run(idle_round(server, args.ttft_samples, args.stream_requests,
                                                       args.max_tokens))
        print("idle:", json.dumps({k: v for k, v in report["idle_before"].items() if k != "ttft_s"}), flush=True)
        report["batch"] = asyncio.run(batch_round(server, args.lines, args.max_tokens))
        print("batch:", report["batch"]["status"], report["batch"]["counts"], f"{report['batch']['batch_tok_s']:.1f} tok/s",
              f"{len(report['batch']['ttft_s'])} interactive", flush=True)
        report["idle_after"] = asyncio.run(idle_round(server, args.ttft_samples, args.stream_requests,
                                                      args.max_tokens))
        report["summary"] = summary(report)
        print("summary:", json.dumps(report["summary"]), flush=True)
        if not args.no_compare:
            report["alone"] = compare_alone(server, report["batch"]["outputs"], args.max_tokens)
            print("alone:", json.dumps({k: v for k, v in report["alone"].items() if k != "differences"}), flush=True)
    finally:
        server.stop()
    report["batch"]["outputs"] = len(report["batch"]["outputs"])
    if args.kill:
        report["kill"] = kill_run(model, work / "kill.db", args.lines, args.max_tokens, server_args)
        print("kill:", json.dumps(report["kill"]), flush=True)
    report["load_after"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
