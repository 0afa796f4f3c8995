"""The bench against ortserve itself (`ortserve serve` on the tiny synthetic model) and engine-direct mode
on the same folder: same prompts, same token counts, both paths complete."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import main
from bench.report import load_report
from tests.integration.server.conftest import stop_process, wait_healthy

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[3]
OUTPUT_TOKENS = 12


@pytest.fixture(scope="module")
def ortserve(tiny_model: Path):
    """`python -m server serve` on the tiny model, in its own process; yields (base url, pid)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--model", str(tiny_model), "--host",
                             "127.0.0.1", "--port", str(port), "--provider", "cpu", "--intra-op-threads", "1",
                             "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        # NOTE(lead): /health, not /v1/models: the model list answers while the engine still loads.
        try:
            wait_healthy(f"http://127.0.0.1:{port}", lambda: proc.poll() is None, 120, poll_s=0.2)
        except RuntimeError as exc:
            raise RuntimeError(f"ortserve did not become ready ({exc}): {proc.stderr.read()[-2000:]}") from None
        yield url, proc.pid
    finally:
        stop_process(proc, 30)


def _args(tmp_path: Path, name: str) -> list[str]:
    return ["--num-requests", "4", "--prompt-tokens", "8", "--output-tokens", str(OUTPUT_TOKENS), "--warmup", "1",
            "--no-progress", "--out", str(tmp_path / f"{name}.json"), "--label", name]


def test_http_and_engine_direct_serve_the_same_requests(ortserve, tiny_model, tmp_path):
    url, pid = ortserve
    assert main(["--url", url, "--concurrency", "1,2", "--server-pid", str(pid), *_args(tmp_path, "http")]) == 0
    assert main(["--engine", str(tiny_model), "--concurrency", "1,2", *_args(tmp_path, "engine")]) == 0
    http, engine = load_report(tmp_path / "http.json"), load_report(tmp_path / "engine.json")
    assert engine["settings"]["mode"] == "engine-direct" and http["settings"]["mode"] == "http"
    for run_http, run_engine in zip(http["runs"], engine["runs"], strict=True):
        assert run_http["key"] == run_engine["key"]
        for rh, re_ in zip(run_http["records"], run_engine["records"], strict=True):
            # ignore_eos is honoured: every request runs to max_tokens, on both paths.
            assert rh["error_kind"] is None and re_["error_kind"] is None
            assert rh["usage_completion_tokens"] == re_["usage_completion_tokens"] == OUTPUT_TOKENS
            assert rh["finish_reason"] == re_["finish_reason"] == "length"
            # The server's chat template + tokenizer and the engine-direct path see the same prompt.
            assert rh["usage_prompt_tokens"] == re_["usage_prompt_tokens"] > 8
            assert rh["ttft_ms"] > 0 and re_["ttft_ms"] > 0
        rss = run_http["rss"]
        assert rss["pid"] == pid and rss["rss_end_bytes"] > 10e6


def test_json_schema_scenario_sends_constrained_requests(ortserve, tiny_model, tmp_path):
    import json

    import jsonschema
    import openai

    from bench.loadgen import HttpBackend, HttpSettings
    from bench.scenarios import iter_requests

    url, _ = ortserve
    for mode in (["--url", url], ["--engine", str(tiny_model)]):
        name = "json-" + mode[0].strip("-")
        assert main([*mode, "--scenario", "json_schema", "--concurrency", "2", *_args(tmp_path, name)]) == 0
        run = load_report(tmp_path / f"{name}.json")["runs"][0]
        assert run["scenario"] == "json_schema"
        for record in run["records"]:
            # the schema's minItems keeps the grammar open past max_tokens: every answer is max_tokens long
            assert record["error_kind"] is None and record["finish_reason"] == "length"
            assert record["usage_completion_tokens"] == OUTPUT_TOKENS
    # what the bench sends is a response_format the server enforces
    spec = next(iter_requests("json_schema", 1, 8, 400))
    body = HttpBackend(HttpSettings(url=url, model=None))._body(spec)
    body.update(stream=False, max_tokens=2000)
    del body["stream_options"], body["model"]
    text = openai.OpenAI(base_url=url, api_key="x").chat.completions.create(
        model="model", messages=[{"role": "user", "content": spec.prompt}], **body).choices[0].message.content
    assert text.startswith('{"records":[{"id":')
    if text.endswith("}"):  # completed within 2000 tokens: then it is valid
        jsonschema.validate(json.loads(text), spec.json_schema)
