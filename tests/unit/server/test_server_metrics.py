"""ServerMetrics / RequestTracker: exact counts from hand-built engine outputs, one registry per app; every series
carries vLLM's model_name label."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.types import EngineStats, FinishReason, RequestOutput
from server.metrics import REJECTED, ServerMetrics


SMOL = 'model_name="smol"'


def _samples(m: ServerMetrics, stats: EngineStats | dict[str, EngineStats] | None = None) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(m.render(stats).decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                continue
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _out(n: int, finished: bool = False, reason: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", "x", (1,), num_prompt_tokens=5, num_generated_tokens=n, finished=finished,
                         finish_reason=reason)


def test_one_request_is_counted_exactly() -> None:
    m = ServerMetrics("smol")
    t = m.tracker()
    t.submitted()
    for out in (_out(1), _out(3), _out(4, True, FinishReason.LENGTH)):
        t.on_output(out)
    t.finish("length")
    t.finish("abort")  # a second outcome is ignored
    s = _samples(m)
    assert s[f"ortserve_time_to_first_token_seconds_count{{{SMOL}}}"] == 1
    assert s[f"ortserve_request_queue_time_seconds_count{{{SMOL}}}"] == 1
    assert s[f"ortserve_inter_token_latency_seconds_count{{{SMOL}}}"] == 3  # tokens 2, 3 and 4
    assert s[f"ortserve_e2e_request_latency_seconds_count{{{SMOL}}}"] == 1
    assert s[f"ortserve_prompt_tokens_total{{{SMOL}}}"] == 5 and s[f"ortserve_generation_tokens_total{{{SMOL}}}"] == 4
    assert s[f'ortserve_requests_total{{{SMOL},status="length"}}'] == 1
    assert s[f'ortserve_requests_total{{{SMOL},status="abort"}}'] == 0


def test_rejected_requests_have_no_latencies() -> None:
    m = ServerMetrics("smol")
    m.tracker().finish(REJECTED)
    s = _samples(m)
    assert s[f'ortserve_requests_total{{{SMOL},status="rejected"}}'] == 1
    assert s[f"ortserve_e2e_request_latency_seconds_count{{{SMOL}}}"] == 0
    assert s[f"ortserve_generation_tokens_total{{{SMOL}}}"] == 0


def test_gauges_come_from_engine_stats_and_registries_are_separate() -> None:
    a, b = ServerMetrics("smol"), ServerMetrics("smol")
    s = _samples(a, EngineStats(num_running=3, num_waiting=2, num_slots_free=5, num_slots_total=8))
    assert (s[f"ortserve_requests_running{{{SMOL}}}"], s[f"ortserve_requests_waiting{{{SMOL}}}"],
            s[f"ortserve_kv_slots_free{{{SMOL}}}"]) == (3, 2, 5)
    assert s[f"ortserve_kv_slots_total{{{SMOL}}}"] == 8
    a.tracker().finish("stop")
    assert _samples(b)[f'ortserve_requests_total{{{SMOL},status="stop"}}'] == 0
    assert _samples(a)[f'ortserve_requests_total{{{SMOL},status="stop"}}'] == 1


def test_every_series_carries_the_model_of_its_request() -> None:
    """Two models (the hub): each request's series, each engine's gauges and totals under its own model_name;
    an unloaded model's gauges go and its counters stay."""
    m = ServerMetrics("smol")
    for name, tokens in (("smol", 2), ("gemma", 3), ("gemma", 4)):
        t = m.tracker()
        t.model_name = name
        t.on_output(_out(1))
        t.on_output(_out(tokens, True, FinishReason.STOP))
        t.finish("stop")
    stats = {"smol": EngineStats(num_running=1, num_waiting=0, num_slots_free=3, num_slots_total=4,
                                 extra={"steps_total": 10.0, "engine_phase_prefill_s": 0.5}),
             "gemma": EngineStats(num_running=2, num_waiting=1, num_slots_free=0, num_slots_total=2,
                                  extra={"steps_total": 7.0, "engine_phase_prefill_s": 0.25})}
    s = _samples(m, stats)
    gemma = 'model_name="gemma"'
    assert s[f'ortserve_requests_total{{{gemma},status="stop"}}'] == 2
    assert s[f'ortserve_requests_total{{{SMOL},status="stop"}}'] == 1
    assert (s[f"ortserve_generation_tokens_total{{{SMOL}}}"], s[f"ortserve_generation_tokens_total{{{gemma}}}"]) \
        == (2, 7)
    assert s[f"ortserve_inter_token_latency_seconds_count{{{gemma}}}"] == 2 + 3  # tokens after each first
    assert (s[f"ortserve_requests_running{{{SMOL}}}"], s[f"ortserve_requests_running{{{gemma}}}"]) == (1, 2)
    assert (s[f"ortserve_kv_slots_free{{{SMOL}}}"], s[f"ortserve_kv_slots_free{{{gemma}}}"]) == (3, 0)
    assert (s[f"ortserve_engine_steps_total{{{SMOL}}}"], s[f"ortserve_engine_steps_total{{{gemma}}}"]) == (10, 7)
    assert s[f'ortserve_engine_step_phase_seconds_total{{{gemma},phase="prefill"}}'] == 0.25
    unlabeled = {k for k in s if k.startswith("ortserve_") and "model_name=" not in k}
    assert not unlabeled, f"series without model_name: {sorted(unlabeled)}"
    m.forget_model("gemma")
    s = _samples(m, {"smol": stats["smol"]})
    assert f"ortserve_requests_running{{{gemma}}}" not in s and f"ortserve_kv_slots_free{{{gemma}}}" not in s
    assert s[f'ortserve_requests_total{{{gemma},status="stop"}}'] == 2  # counters keep what was counted
    assert s[f"ortserve_engine_steps_total{{{SMOL}}}"] == 10  # the same totals again add nothing


def test_gateway_metrics_carry_vllm_names_and_token_fractions() -> None:
    """The endpoint picker's three gauges, the prefix counters and cache_config_info, from exact engine stats."""
    m = ServerMetrics("smol")
    stats = EngineStats(num_running=2, num_waiting=1, num_slots_free=2, num_slots_total=4,
                        extra={"prefix_cache_queries_total": 300.0, "prefix_cache_hits_total": 120.0},
                        num_kv_tokens_used=1024, num_kv_tokens_cached=100, num_kv_tokens_total=4 * 2048)
    s = _samples_with_model(m, stats)
    assert s['vllm:num_requests_running{model_name="smol"}'] == 2
    assert s['vllm:num_requests_waiting{model_name="smol"}'] == 1
    assert s['vllm:kv_cache_usage_perc{model_name="smol"}'] == 1024 / 8192  # cached prefixes are not "used"
    assert (s[f"ortserve_kv_cache_used_tokens{{{SMOL}}}"], s[f"ortserve_kv_cache_cached_tokens{{{SMOL}}}"],
            s[f"ortserve_kv_cache_capacity_tokens{{{SMOL}}}"]) == (1024, 100, 8192)
    assert s['vllm:prefix_cache_queries_total{model_name="smol"}'] == 300
    assert s['vllm:prefix_cache_hits_total{model_name="smol"}'] == 120
    (info,) = [k for k in s if k.startswith("vllm:cache_config_info")]
    assert s[info] == 1
    assert 'block_size="16"' in info and 'num_gpu_blocks="512"' in info and 'enable_prefix_caching="True"' in info
    assert 'num_slots="4"' in info and 'max_model_len="2048"' in info
    # Counters advance by the engine totals' growth; a second scrape with the same totals adds nothing.
    stats2 = EngineStats(num_running=0, num_waiting=0, num_slots_free=4, num_slots_total=4,
                         extra={"prefix_cache_queries_total": 350.0, "prefix_cache_hits_total": 160.0},
                         num_kv_tokens_used=0, num_kv_tokens_cached=1124, num_kv_tokens_total=4 * 2048)
    _samples_with_model(m, stats2)
    s = _samples_with_model(m, stats2)
    assert s['vllm:prefix_cache_queries_total{model_name="smol"}'] == 350
    assert s['vllm:prefix_cache_hits_total{model_name="smol"}'] == 160
    assert s[f"ortserve_prefix_cache_hits_total{{{SMOL}}}"] == 160
    assert s['vllm:kv_cache_usage_perc{model_name="smol"}'] == 0


def test_vllm_series_are_absent_while_loading() -> None:
    s = _samples(ServerMetrics("smol"), None)
    assert not [k for k in s if k.startswith("vllm:")]


def _samples_with_model(m: ServerMetrics, stats: EngineStats) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(m.render(stats, model_name="smol").decode()):
        for s in family.samples:
            if "le" in s.labels or s.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
