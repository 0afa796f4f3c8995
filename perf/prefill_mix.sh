#!/usr/bin/env bash
# Issue 25: time to first token against inter-token latency when a step's prefill budget goes to every waiting
# prompt (--max-prefills-per-step 0, the default) or to one prompt per step (1, the behaviour before).
# Two `ortserve serve` of the same model run side by side; the idle one is paused (SIGSTOP) while the other is
# measured by `ortserve bench` (openai client, CONCURRENCY closed-loop streams, distinct prompts, temperature
# TEMPERATURE), in interleaved rounds, the order alternating. Reports land in $OUT/<label>-r<round>.json.
#
# Usage: perf/prefill_mix.sh        (env overrides below; ROUNDS=5 TEMPERATURE=0 ... )
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench/results/prefill-mix-$(date +%Y%m%d-%H%M%S)}
ROUNDS=${ROUNDS:-3}
CONCURRENCY=${CONCURRENCY:-8}
REQUESTS=${REQUESTS:-16}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
TEMPERATURE=${TEMPERATURE:-1.0}
MODEL=${MODEL:-$("$PY" -c 'from engine.builder.pull import pull_model; print(pull_model(progress=False))')}
mkdir -p "$OUT"
log() { echo "[prefill_mix] $(date +%H:%M:%S) $*" >&2; }
source "$ROOT/perf/servers.sh"  # PIDS, stop_servers (on exit), wait_ready
declare -A PORT=([mixed]=8021 [one]=8022) ARG=([mixed]=0 [one]=1) PID=()
for label in mixed one; do
  "$PY" -m server serve --model "$MODEL" --host 127.0.0.1 --port "${PORT[$label]}" --provider cpu --intra-op-threads 2 \
      --max-prefills-per-step "${ARG[$label]}" --log-level warning > "$OUT/$label.log" 2>&1 &
  PID[$label]=$!; PIDS+=($!)
done
for label in mixed one; do wait_ready "http://127.0.0.1:${PORT[$label]}/v1" "${PID[$label]}"; done
for ((r = 0; r < ROUNDS; r++)); do
  order=(mixed one); ((r % 2)) && order=(one mixed)
  for label in "${order[@]}"; do
    other=$([[ $label == mixed ]] && echo one || echo mixed)
    kill -STOP "${PID[$other]}"; kill -CONT "${PID[$label]}"
    echo "[prefill_mix] round $r $label (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    "$PY" -m bench.cli --url "http://127.0.0.1:${PORT[$label]}/v1" --concurrency "$CONCURRENCY" \
        --num-requests "$REQUESTS" --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" \
        --temperature "$TEMPERATURE" --seed "$r" --label "$label" --no-progress --out "$OUT/$label-r$r.json" >&2
    cut -d' ' -f1-3 /proc/loadavg > "$OUT/$label-r$r.load"
  done
done
"$PY" - "$OUT" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*-r*.json")):
    label, rnd = f.stem.rsplit("-r", 1)
    run = json.loads(f.read_text())["runs"][0]["summary"]
    rows.setdefault(label, []).append((run["ttft"]["p50_ms"], run["ttft"]["p99_ms"], run["itl"]["p50_ms"],
                                       run["itl"]["p99_ms"], run["output_tokens_per_s"]))
names = ("TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "output tok/s")
summary = {label: {n: {"median": statistics.median(v[i] for v in vals), "rounds": [v[i] for v in vals]}
                   for i, n in enumerate(names)} for label, vals in rows.items()}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
for label, s in summary.items():
    print(label, " | ".join(f"{n} {s[n]['median']:.1f} ({', '.join(f'{x:.0f}' for x in s[n]['rounds'])})" for n in names))
PYEOF
