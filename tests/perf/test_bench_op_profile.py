"""perf.op_profile on the tiny model: every node of a decode step is counted, MatMulNBits among them."""

from __future__ import annotations

from pathlib import Path

from perf.op_profile import profile_decode


def test_profile_counts_the_decode_steps_nodes(tiny_model: Path) -> None:
    got = profile_decode(tiny_model, threads=1, steps=4, prompt_tokens=8, max_length=64)
    assert got["runs"] == 4
    assert got["nodes_per_run"] == sum(f["nodes"] for f in got["ops"].values())
    assert "MatMulNBits" in got["ops"] and "GroupQueryAttention" in got["ops"]
    assert abs(sum(f["share"] for f in got["ops"].values()) - 1.0) < 1e-9
