"""bench.sizes' arithmetic: decode rates from what the client saw, within-round ratios, KV bytes from the files, the
process tree's RSS, the report's text and plot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from bench import sizes
from bench.metrics import RequestRecord
from engine.builder import SyntheticSpec, build_synthetic


def _record(tokens: int, ttft: float, last: float, error: str | None = None) -> RequestRecord:
    r = RequestRecord(index=0, start_s=0.0, num_prompt_tokens_target=32, max_tokens=tokens)
    r.ttft_s, r.last_chunk_s, r.usage_completion_tokens = ttft, last, tokens
    r.error_kind = error
    return r


def test_decode_rate_counts_the_tokens_after_the_first():
    assert sizes.decode_rate(_record(33, 2.0, 10.0)) == pytest.approx(4.0)
    assert sizes.decode_rate(_record(1, 2.0, 2.0)) is None
    assert sizes.decode_rate(_record(33, 2.0, 10.0, error="http_5xx")) is None


def _round(ours: float, peer: float, ttft_ours: float, ttft_peer: float) -> dict:
    return {"ortserve": {"decode_tok_s_1": ours, "decode_tok_s_2": 2 * ours, "ttft_s": ttft_ours, "load_s": 60.0,
                         "peak_rss_bytes": 7 << 30},
            "llama-server": {"decode_tok_s_1": peer, "decode_tok_s_2": None, "ttft_s": ttft_peer, "load_s": 40.0,
                             "peak_rss_bytes": 6 << 30}}


def test_ratios_are_taken_within_each_round_then_the_median():
    report = {"settings": {"slots": 2, "ttft_prompt_tokens": 2000, "threads": 2, "gguf": "x.gguf"},
              "rounds": [_round(2.0, 1.0, 100.0, 50.0), _round(1.0, 2.0, 100.0, 100.0), _round(3.0, 2.0, 90.0, 60.0)],
              "kv_bytes_per_token": {"ortserve": 131072, "llama-server": 131072}, "conversion": None}
    summary = sizes.summarize(report)
    assert summary["decode_tok_s_1"] == {"ortserve": 2.0, "llama-server": 2.0, "ratio": 1.5}  # ratios 2, 0.5, 1.5
    assert summary["decode_tok_s_2"]["ratio"] is None  # the peer's failed: no ratio, not a zero
    assert summary["ttft_s"]["ratio"] == pytest.approx(1.5)
    report["summary"] = summary
    text = sizes.format_summary(report)
    assert "peak_rss_bytes" in text and "7.00 GiB" in text and "1.17" in text  # (a ratio has no unit)


def test_kv_bytes_per_token_from_the_folder_and_the_gguf(tmp_path: Path):
    folder = build_synthetic(tmp_path / "m", SyntheticSpec(num_layers=3, num_kv_heads=2, hidden_size=64, num_heads=4))
    assert sizes.kv_bytes_per_token_ours(folder) == 2 * 3 * 2 * 16 * 4  # float32 KV
    path = tmp_path / "h.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("llama.block_count", 32), ("llama.attention.head_count", 32),
                       ("llama.attention.head_count_kv", 8), ("llama.embedding_length", 4096)):
        w.add_uint32(key, value)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert sizes.kv_bytes_per_token_peer(path) == 2 * 32 * 8 * 128 * 2  # llama.cpp's f16 cache: 128 KiB


def test_the_process_tree_rss_and_cpu_include_this_process():
    assert sizes.tree_rss_bytes(os.getpid()) > 10 << 20
    assert sizes.tree_rss_bytes(2**22 + 12345) == 0  # (no such process)
    before = sizes.tree_cpu_s(os.getpid())
    sum(i * i for i in range(3_000_000))  # some CPU work
    assert sizes.tree_cpu_s(os.getpid()) > before > 0


def test_the_plot_is_written(tmp_path: Path):
    report = {"settings": {"slots": 2, "ttft_prompt_tokens": 2000, "threads": 2, "gguf": "x.gguf"},
              "rounds": [_round(2.0, 1.0, 100.0, 50.0)],
              "kv_bytes_per_token": {"ortserve": 131072, "llama-server": 131072},
              "conversion": {"wall_s": 90.0, "peak_rss_bytes": 2 << 30, "gguf_bytes": 5 << 30, "folder_bytes": 6 << 30}}
    report["summary"] = sizes.summarize(report)
    path = sizes.plot(report, tmp_path / "p.png")
    assert path.stat().st_size > 10_000
    json.dumps(report)  # the report is JSON as it is
