"""bench.report (JSON document, compare ratios), bench.loadgen's loopback guard and error classes."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from bench.loadgen import RemoteUrlError, RunResult, check_loopback, classify_error
from bench.metrics import RequestRecord, Slo
from bench.report import (SCHEMA, build_report, compare, format_compare, load_report, machine_info, run_entry,
                          write_report)


def result(ttft_s: float, e2e_s: float, num: int = 4, tokens: int = 10) -> RunResult:
    records = [RequestRecord(index=i, start_s=0.0, num_prompt_tokens_target=8, max_tokens=tokens, ttft_s=ttft_s,
                             itl_s=[(e2e_s - ttft_s) / (tokens - 1)] * (tokens - 1), e2e_s=e2e_s,
                             num_chunks=tokens, usage_prompt_tokens=8, usage_completion_tokens=tokens,
                             finish_reason="length") for i in range(num)]
    return RunResult(records=records, duration_s=2.0, num_not_sent=0)


def report(label: str, ttft_s: float, e2e_s: float, levels=(1, 4)) -> dict:
    runs = [run_entry(result(ttft_s, e2e_s, num=4 * c), slo=Slo(), concurrency=c) for c in levels]
    return build_report(label, {"model": "m", "prompt_tokens": 8, "output_tokens": 10}, runs)


def test_report_round_trips_through_json(tmp_path):
    r = report("x", 0.1, 1.0)
    path = write_report(r, tmp_path / "sub" / "x.json")
    back = load_report(path)
    assert back == json.loads(json.dumps(r)) and back["schema"] == SCHEMA
    assert [run["key"] for run in back["runs"]] == ["c=1", "c=4"]
    assert back["runs"][1]["summary"]["num_ok"] == 16 and len(back["runs"][1]["records"]) == 16


def test_load_report_refuses_other_json(tmp_path):
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not an ortserve bench report"):
        load_report(tmp_path / "other.json")


def test_compare_ratios_are_to_the_first_report_level_by_level():
    base, other = report("base", 0.1, 1.0), report("other", 0.2, 1.0, levels=(1,))
    rows = compare([base, other])
    assert [(r["key"], r["label"]) for r in rows] == [("c=1", "base"), ("c=1", "other"), ("c=4", "base")]
    assert rows[0]["ratios"]["TTFT p50"] == pytest.approx(1.0)
    assert rows[1]["ratios"]["TTFT p50"] == pytest.approx(2.0)
    # Same tokens in the same duration: equal throughput; TPOT (0.8 s / 9 vs 0.9 s / 9) is 8/9.
    assert rows[1]["ratios"]["out tok/s"] == pytest.approx(1.0)
    assert rows[1]["ratios"]["TPOT p50"] == pytest.approx(8 / 9)
    table = format_compare(rows)
    assert "(2.00x)" in table and "(0.89x)" in table and "first file's (base)" in table


def test_machine_info_reads_this_machine():
    info = machine_info()
    assert info["num_cpus_logical"] >= 1 and info["mem_total_bytes"] > 0 and info["versions"]["numpy"]


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://localhost:1/v1", "http://[::1]:8000/v1",
                                 "http://127.9.9.9/v1"])
def test_loopback_urls_pass(url):
    check_loopback(url)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000/v1", "https://api.example.org/v1", "http://0.0.0.0:8000/v1"])
def test_remote_urls_are_refused_unless_allowed(url):
    with pytest.raises(RemoteUrlError, match="--allow-remote"):
        check_loopback(url)
    check_loopback(url, allow_remote=True)


def _status_error(cls, status: int):
    req = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    return cls("msg", response=httpx.Response(status, request=req), body=None)


def test_errors_are_classified_by_class_and_phase():
    req = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    assert classify_error(_status_error(openai.RateLimitError, 429)) == "http_429"
    assert classify_error(_status_error(openai.InternalServerError, 503)) == "http_5xx"
    assert classify_error(_status_error(openai.BadRequestError, 400)) == "http_4xx"
    assert classify_error(openai.APITimeoutError(request=req)) == "timeout"
    assert classify_error(TimeoutError()) == "timeout"
    assert classify_error(openai.APIConnectionError(request=req)) == "connection"
    assert classify_error(openai.APIConnectionError(request=req), mid_stream=True) == "dropped_stream"
    assert classify_error(httpx.RemoteProtocolError("x"), mid_stream=True) == "dropped_stream"
    assert classify_error(openai.APIError("in-stream error", request=req, body=None)) == "stream_error"
    assert classify_error(KeyError("x")) == "other"
