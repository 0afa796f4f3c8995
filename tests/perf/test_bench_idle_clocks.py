"""perf/gpu/idle_clocks.py: each request after idle beside its prompt steps and the GPU clock samples."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from perf.gpu import idle_clocks


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]  # nvidia-smi's own form (ms)


def test_requests_line_up_with_their_prompt_steps_and_the_clock_samples(tmp_path: Path) -> None:
    t0 = 1_800_000_000.0
    # a cold GPU (P8, 345 MHz) until t0 + 0.04, then clocked up (P0, 1980 MHz); one row nvidia-smi could not read
    rows = [f"{_stamp(t0 + i * 0.02)}, {345 if i < 2 else 1980}, 2619, {'P8' if i < 2 else 'P0'}, 75.5, 0"
            for i in range(10)]
    (tmp_path / "clocks.csv").write_text("\n".join([*rows, "[N/A], [N/A]"]) + "\n")
    steps = [
        {"t": t0 + 0.031, "ms": 60.0, "prefill": [512], "decode": 0, "runs": [["prefill", 58.0]]},  # cold
        {"t": t0 + 0.092, "ms": 3.0, "prefill": [], "decode": 1, "runs": [["decode", 2.5]]},  # not a prompt step
        {"t": t0 + 0.150, "ms": 15.0, "prefill": [512], "decode": 0, "runs": [["prefill", 14.0]]},  # warm
        {"t": t0 + 0.160, "gc": 0, "ms": 1.0, "thread": "x"},
    ]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    requests = [{"idle_s": 10.0, "sent_s": t0 + 0.030, "first_s": t0 + 0.095, "done_s": t0 + 0.12},
                {"idle_s": 0.0, "sent_s": t0 + 0.145, "first_s": t0 + 0.170, "done_s": t0 + 0.19}]
    (tmp_path / "requests.json").write_text(json.dumps(requests))

    assert len(idle_clocks.read_clocks(tmp_path / "clocks.csv")) == 10
    cold, warm = idle_clocks.show_dir(tmp_path)
    assert cold["prompt_runs_ms"] == [58.0] and warm["prompt_runs_ms"] == [14.0]
    assert (cold["sm_mhz_before"], cold["pstate_before"]) == (345.0, "P8")
    assert (cold["sm_mhz_during"], cold["pstate_during"]) == (1980.0, "P0")  # mid-step: t0 + 0.061
    assert warm["sm_mhz_before"] == 1980.0 and warm["ttft_ms"] == 25.0
    assert json.loads((tmp_path / "idle_clocks.json").read_text())[0]["idle_s"] == 10.0
