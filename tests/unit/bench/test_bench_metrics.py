"""bench.metrics on hand-built records with exact expected figures."""

from __future__ import annotations

import pytest

from bench.metrics import RequestRecord, Slo, distribution, summarize


def rec(index: int, *, ttft: float | None = 0.1, itl: list[float] | None = None, e2e: float | None = 1.0,
        chunks: int = 10, usage: int | None = 10, prompt: int | None = 20, error: str | None = None) -> RequestRecord:
    return RequestRecord(index=index, start_s=0.0, num_prompt_tokens_target=20, max_tokens=10, ttft_s=ttft,
                         itl_s=list(itl if itl is not None else [0.1] * (chunks - 1)), e2e_s=e2e, num_chunks=chunks,
                         usage_prompt_tokens=prompt, usage_completion_tokens=usage,
                         finish_reason=None if error else "length", error_kind=error)


def test_distribution_percentiles_are_linear_interpolation_in_ms():
    d = distribution([0.010, 0.020, 0.030, 0.040])
    assert d["n"] == 4
    assert d["mean_ms"] == pytest.approx(25.0)
    assert d["p50_ms"] == pytest.approx(25.0)
    assert d["p90_ms"] == pytest.approx(37.0)  # rank 0.9 * 3 = 2.7 -> 30 + 0.7 * 10
    assert d["p99_ms"] == pytest.approx(39.7)
    assert (d["min_ms"], d["max_ms"]) == (pytest.approx(10.0), pytest.approx(40.0))


def test_distribution_of_nothing_is_none_not_zero():
    d = distribution([])
    assert d["n"] == 0 and d["mean_ms"] is None and d["p99_ms"] is None


def test_tpot_and_token_count_fallback():
    r = rec(0, ttft=0.1, e2e=1.0, usage=10)
    assert r.tpot_s == pytest.approx(0.1)  # (1.0 - 0.1) / (10 - 1)
    no_usage = rec(1, usage=None, chunks=7, e2e=0.7)
    assert no_usage.num_output_tokens == 7 and no_usage.tpot_s == pytest.approx(0.1)
    assert rec(2, usage=1, chunks=1).tpot_s is None


def test_summarize_counts_errors_throughput_and_goodput():
    records = [rec(0), rec(1, ttft=0.3), rec(2, error="http_429", ttft=None, chunks=0, usage=None, prompt=None),
               rec(3, error="dropped_stream", chunks=4, usage=None, e2e=0.5)]
    s = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=200))
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (4, 2, 2)
    assert s["errors"] == {"http_429": 1, "dropped_stream": 1}
    assert s["request_throughput_per_s"] == pytest.approx(1.0)
    # Tokens received count even from the dropped stream: 10 + 10 + 0 + 4.
    assert s["num_output_tokens"] == 24 and s["output_tokens_per_s"] == pytest.approx(12.0)
    assert s["ttft"]["n"] == 2 and s["ttft"]["mean_ms"] == pytest.approx(200.0)
    assert s["itl"]["n"] == 18
    assert s["goodput"]["num_met"] == 1 and s["goodput"]["fraction"] == pytest.approx(0.25)
    assert s["goodput"]["requests_per_s"] == pytest.approx(0.5)
    assert s["prefill_tokens_per_s_mean"] == pytest.approx((20 / 0.1 + 20 / 0.3) / 2)
    assert s["decode_tokens_per_s_per_stream"] == pytest.approx(1 / ((0.9 / 9 + 0.7 / 9) / 2))


def test_tpot_bound_in_the_slo():
    fast, slow = rec(0, e2e=0.55), rec(1, e2e=2.0)  # tpot 50 ms and ~211 ms
    s = summarize([fast, slow], 1.0, Slo(tpot_ms=100))
    assert s["goodput"]["num_met"] == 1


def test_usage_and_stream_count_mismatch_is_reported():
    s = summarize([rec(0, usage=10, chunks=10), rec(1, usage=10, chunks=9)], 1.0)
    assert s["token_count_check"] == {"num_with_usage": 2, "num_mismatched": 1, "mismatched_indices": [1]}


def test_record_json_round_trip_in_ms():
    r = rec(5, ttft=0.1234567, itl=[0.01, 0.02], e2e=0.5, chunks=3)
    d = r.to_json()
    assert d["ttft_ms"] == 123.457 and d["itl_ms"] == [10.0, 20.0] and "ttft_s" not in d
    back = RequestRecord.from_json(d)
    assert back.ttft_s == pytest.approx(0.123457) and back.itl_s == pytest.approx([0.01, 0.02])
    assert back.index == 5 and back.num_chunks == 3 and back.e2e_s == pytest.approx(0.5)


def test_goodput_without_an_slo_is_every_successful_request():
    # A request whose only token decoded to no text has no TTFT but still succeeded.
    records = [rec(0), rec(1, ttft=None, chunks=0, usage=1, itl=[]), rec(2, error="http_5xx")]
    assert summarize(records, 1.0)["goodput"]["num_met"] == 2
    assert summarize(records, 1.0, Slo(ttft_ms=1000))["goodput"]["num_met"] == 1


def test_content_chunks_give_ttft_then_one_gap_each_and_survive_json() -> None:
    record = RequestRecord(index=0, start_s=0.0, num_prompt_tokens_target=4, max_tokens=3)
    for elapsed_s in (0.25, 0.375, 0.5):
        record.add_content_chunk(elapsed_s)
    assert record.ttft_s == 0.25 and record.itl_s == [0.125, 0.125] and record.num_chunks == 3
    assert record.last_chunk_s == 0.5
    again = RequestRecord.from_json(record.to_json())
    assert again.ttft_s == record.ttft_s and again.itl_s == record.itl_s and again.last_chunk_s == 0.5
