"""ServerMetrics / RequestTracker: exact counts from hand-built engine outputs, one registry per app."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.types import EngineStats, FinishReason, RequestOutput
from server.metrics import REJECTED, ServerMetrics


def _samples(m: ServerMetrics, stats: EngineStats | None = None) -> dict[str, float]:
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
    m = ServerMetrics()
    t = m.tracker()
    t.submitted()
    for out in (_out(1), _out(3), _out(4, True, FinishReason.LENGTH)):
        t.on_output(out)
    t.finish("length")
    t.finish("abort")  # a second outcome is ignored
    s = _samples(m)
    assert s["ortserve_time_to_first_token_seconds_count"] == 1
    assert s["ortserve_request_queue_time_seconds_count"] == 1
    assert s["ortserve_inter_token_latency_seconds_count"] == 3  # tokens 2, 3 and 4
    assert s["ortserve_e2e_request_latency_seconds_count"] == 1
    assert s["ortserve_prompt_tokens_total"] == 5 and s["ortserve_generation_tokens_total"] == 4
    assert s['ortserve_requests_total{status="length"}'] == 1
    assert s['ortserve_requests_total{status="abort"}'] == 0


def test_rejected_requests_have_no_latencies() -> None:
    m = ServerMetrics()
    m.tracker().finish(REJECTED)
    s = _samples(m)
    assert s['ortserve_requests_total{status="rejected"}'] == 1
    assert s["ortserve_e2e_request_latency_seconds_count"] == 0
    assert s["ortserve_generation_tokens_total"] == 0


def test_gauges_come_from_engine_stats_and_registries_are_separate() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    s = _samples(a, EngineStats(num_running=3, num_waiting=2, num_slots_free=5, num_slots_total=8))
    assert (s["ortserve_requests_running"], s["ortserve_requests_waiting"], s["ortserve_kv_slots_free"]) == (3, 2, 5)
    assert s["ortserve_kv_slots_total"] == 8
    a.tracker().finish("stop")
    assert _samples(b)['ortserve_requests_total{status="stop"}'] == 0
    assert _samples(a)['ortserve_requests_total{status="stop"}'] == 1
