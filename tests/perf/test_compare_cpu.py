"""perf.compare_cpu's summary on hand-built rounds: ratios are taken within a round, then the median."""

from __future__ import annotations

import pytest

from perf.compare_cpu import figures_of, markdown, summarize_report


def summary(*, tpot_ms: float, out_tps: float, ttft_p50_ms: float = 100.0, ttft_p99_ms: float = 200.0,
            prompt_tokens: float | None = 500.0) -> dict:
    return {"summary": {"decode_tokens_per_s_per_stream": 1e3 / tpot_ms, "output_tokens_per_s": out_tps,
                        "ttft": {"p50_ms": ttft_p50_ms, "p99_ms": ttft_p99_ms}, "mean_prompt_tokens": prompt_tokens}}


def round_(scale: float) -> dict:
    """One round; ``scale`` slows every target alike (load), which must cancel out of every ratio."""
    s = 1.0 / scale
    return {
        "load_before": "1.00", "load_after": "1.00",
        "single": {"ortserve": summary(tpot_ms=10 * scale, out_tps=90 * s),
                   "engine": summary(tpot_ms=8 * scale, out_tps=100 * s),
                   "genai": summary(tpot_ms=9 * scale, out_tps=95 * s),
                   "llama.cpp": summary(tpot_ms=12 * scale, out_tps=70 * s)},
        "prefill": {"ortserve": summary(tpot_ms=1, out_tps=1, ttft_p50_ms=500 * scale),
                    "genai": summary(tpot_ms=1, out_tps=1, ttft_p50_ms=800 * scale),
                    "llama.cpp": summary(tpot_ms=1, out_tps=1, ttft_p50_ms=2000 * scale, prompt_tokens=0.0)},
        "batch": {"ortserve": summary(tpot_ms=20, out_tps=300 * s, ttft_p99_ms=1000 * scale),
                  "llama.cpp": summary(tpot_ms=12, out_tps=60 * s, ttft_p50_ms=9000 * scale)},
    }


def test_figures_of_one_round():
    f = figures_of(round_(1.0))
    assert f["decode_ours"] == pytest.approx(100.0)
    assert f["decode_engine"] == pytest.approx(125.0)
    # prompt tokens come from ortserve's usage (llama-cpp-python reports none): 500 tokens / 0.5 s, / 2 s
    assert f["prefill_ours"] == pytest.approx(1000.0)
    assert f["prefill_llama"] == pytest.approx(250.0)
    assert f["outN_ours"] == pytest.approx(300.0)


def test_ratios_are_per_round_then_median_and_load_cancels():
    report = {"settings": {"concurrency": 8}, "rounds": [round_(1.0), round_(2.0), round_(1.3)]}
    s = summarize_report(report)
    r = {x["name"]: x for x in s["ratios"]}
    genai = r["decode, 1 stream: ortserve (HTTP) / onnxruntime-genai"]
    assert genai["per_round"] == pytest.approx([0.9, 0.9, 0.9])
    assert genai["median"] == pytest.approx(0.9) and genai["met"] is False
    prompt = r["prompt processing: ortserve (HTTP) / llama.cpp"]
    assert prompt["median"] == pytest.approx(4.0) and prompt["met"] is True
    assert r["N streams aggregate / ortserve 1 stream (output tok/s)"]["median"] == pytest.approx(300 / 90)
    assert r["N streams: llama.cpp p50 TTFT / ortserve p99 TTFT (> 1: ours lower)"]["median"] == pytest.approx(9.0)
    # the median of the figures themselves follows the middle round
    assert s["figures"]["decode_ours"]["median"] == pytest.approx(100.0 / 1.3)
    text = markdown(s, 8)
    assert "8 streams aggregate: ortserve / llama-cpp-python server" in text and "**5.00x**" in text


def test_a_missing_target_gives_no_ratio_rather_than_a_wrong_one():
    rnd = round_(1.0)
    del rnd["single"]["genai"]
    s = summarize_report({"settings": {"concurrency": 8}, "rounds": [rnd]})
    genai = next(x for x in s["ratios"] if x["name"].startswith("decode, 1 stream: ortserve (HTTP) / onnx"))
    assert genai["median"] is None and genai["met"] is None
