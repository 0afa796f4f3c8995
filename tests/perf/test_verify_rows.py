"""perf.verify_rows on the tiny model: GroupQueryAttention's answer to a batched check, and the timed runs."""

from __future__ import annotations

from pathlib import Path

from perf.verify_rows import measure, refusal, tokens_per_time


def test_a_check_of_several_rows_after_a_past_is_refused_and_lone_runs_are_timed(tiny_model: Path) -> None:
    # NOTE(tests): the probe's premise: if a future onnxruntime runs [k, S] after a past, this fails and the engine's
    # one-run-per-row checks (engine.row_chunks) should be revisited
    assert "batch_size must be 1 when sequence_length > 1 and past context is given" in refusal(
        tiny_model, rows=2, tokens=3, past=8, threads=1)
    found = measure(tiny_model, rows=2, tokens=3, past=8, threads=1, rounds=2)
    steps = found["decode_steps"]
    assert steps["decode_1"] == 1.0 and len(found["times"]["checks_alone"]) == 2
    assert set(steps) == {"decode_1", "decode_k", "checks_alone", "prompt_alone", "prompt_k", "checks_batched_estimate"}
    assert steps["checks_batched_estimate"] <= steps["checks_alone"]
    per_step = tokens_per_time(1.0, 2, 2, {"decode_k": 2.0, "checks_alone": 4.0, "checks_batched_estimate": 2.0})
    assert per_step == {"plain": 1.0, "checks_alone": 1.5, "checks_batched": 3.0}
