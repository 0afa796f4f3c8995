"""Where a server's engine thread spent a bench run: the /metrics phase counters before and after, per step.

    curl -s URL/metrics > before.txt; <bench>; curl -s URL/metrics > after.txt
    python -m perf.gpu.phases before.txt after.txt [--out phases.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def _samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("/" + s.labels["phase"] if "phase" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value  # summed over model_name
    return out


def phases(before: str, after: str) -> dict:
    a, b = _samples(before), _samples(after)
    grew = {k: b[k] - a.get(k, 0.0) for k in b if k.startswith(("ortserve_engine_", "ortserve_generation_tokens"))}
    steps = grew.get("ortserve_engine_steps_total", 0.0)
    per_step = {k.split("/", 1)[1]: round(v / steps * 1e3, 3) for k, v in grew.items()
                if k.startswith("ortserve_engine_step_phase_seconds_total/") and steps}
    wall = sum(grew.get(f"ortserve_engine_step_phase_seconds_total/{p}", 0.0) for p in per_step)
    cpu = grew.get("ortserve_engine_thread_cpu_seconds_total", 0.0)
    return {"steps": steps, "per_step_ms": per_step, "step_ms": round(wall / steps * 1e3, 3) if steps else None,
            "thread_cpu_per_step_ms": round(cpu / steps * 1e3, 3) if steps else None,
            "phase_wall_s": round(wall, 3), "thread_cpu_s": round(cpu, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = phases(args.before.read_text(), args.after.read_text())
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
