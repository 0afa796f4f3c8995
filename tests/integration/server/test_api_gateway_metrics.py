"""The metrics the Kubernetes inference gateway's endpoint picker reads (vLLM's names), on a real server.

KV utilization is the tokens running requests hold over slots x max_model_len: it rises with a long prompt while
that request runs (held at a DecodeGate, so "still running" holds by construction) and is 0 again once it ends,
when its tokens stay in the free slot as prefix cache (ortserve_kv_cache_cached_tokens), evictable like vLLM's
cached blocks. The prefix counters count tokens and agree with usage.prompt_tokens_details.cached_tokens.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx

from server.app import create_app
from tests.conftest import DecodeGate
from tests.integration.server.conftest import RunningServer, api_settings, fault_loader, serve_app

MAX_BATCH = 2
MODEL_LEN = 2048  # api_model's context
LABEL = '{model_name="tiny"}'


def _wait_for(running: RunningServer, ok, what: str, request: concurrent.futures.Future,
              timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = running.metrics()
        if ok(m):
            return m
        assert not request.done(), f"{what}: the request ended: {request.result().text}"
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_kv_usage_moves_with_a_long_prompt_and_returns_to_zero(api_model: Path) -> None:
    gate = DecodeGate()
    settings = api_settings(api_model, max_batch=MAX_BATCH)
    with serve_app(create_app(settings, loader=fault_loader(gate))) as running:
        capacity = MAX_BATCH * MODEL_LEN
        m = running.metrics()
        assert m[f"vllm:kv_cache_usage_perc{LABEL}"] == 0
        assert m[f"vllm:num_requests_running{LABEL}"] == 0 and m[f"vllm:num_requests_waiting{LABEL}"] == 0
        assert m["ortserve_kv_cache_capacity_tokens"] == capacity
        (info,) = [k for k in m if k.startswith("vllm:cache_config_info")]
        assert f'num_gpu_blocks="{capacity // 16}"' in info and 'block_size="16"' in info
        assert 'enable_prefix_caching="True"' in info

        prompt = [(7 * i) % 400 + 10 for i in range(1500)]  # token ids (vocab 512): exactly 1500 prompt tokens
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        gate.shut()  # the prompt prefills, then the request waits at its first decode step
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                first = pool.submit(httpx.post, f"{running.url}/completions", json=body, timeout=120)
                held = _wait_for(running, lambda s: s["ortserve_kv_cache_used_tokens"] == 1500,
                                 "the running request's 1500 prompt tokens never showed", first)
                assert held[f"vllm:kv_cache_usage_perc{LABEL}"] == 1500 / capacity
                assert held[f"vllm:num_requests_running{LABEL}"] == 1
                assert held["ortserve_kv_cache_cached_tokens"] == 0
                gate.open()
                r = first.result(120)
        finally:
            gate.open()
        assert r.status_code == 200, r.text
        done = running.wait_idle(5.0)
        assert done[f"vllm:kv_cache_usage_perc{LABEL}"] == 0 and done["ortserve_kv_cache_used_tokens"] == 0
        # The slot keeps the prompt and the output tokens computed so far (the last one never ran).
        assert done["ortserve_kv_cache_cached_tokens"] == 1500 + 5 - 1
        assert done[f"vllm:prefix_cache_queries_total{LABEL}"] == 1500
        assert done[f"vllm:prefix_cache_hits_total{LABEL}"] == 0

        # The same prompt again: its prefix comes from the cache (all but the last two tokens), in the counters
        # and in the answer's usage alike.
        again = httpx.post(f"{running.url}/completions", json=body, timeout=120).json()
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 1500 - 2
        m = running.wait_idle(5.0)
        assert m[f"vllm:prefix_cache_queries_total{LABEL}"] == 3000
        assert m[f"vllm:prefix_cache_hits_total{LABEL}"] == cached
        assert m["ortserve_prefix_cache_hits_total"] == cached
        assert m[f"vllm:kv_cache_usage_perc{LABEL}"] == 0
