#!/usr/bin/env bash
# `ortserve bench` CPU figures of two revisions on the same machine, interleaved: a server from a worktree of REV
# and one from this tree, both on the default model, each round benching one then the other (the order alternates).
#   bash perf/before_after.sh REV [ROUNDS]    -> perf-out/before_after/{before,after}-rN.json, starts.txt, summary.json
# First the start-up time of each, alone (STARTS=3 rounds: process start to its first chat answer), then the bench.
# Ratios are HEAD/REV of the medians over rounds (output tok/s, TTFT p50, ITL p50); within 0.95-1.05 is noise.
set -euo pipefail
REV=${1:?usage: before_after.sh REV [ROUNDS]}; ROUNDS=${2:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd); PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/perf-out/before_after}; mkdir -p "$OUT"; rm -f "$OUT/starts.txt"
WT=$(mktemp -d /tmp/before-XXXX); git -C "$ROOT" worktree add --detach "$WT" "$REV" >/dev/null
cleanup() { kill $B $A 2>/dev/null || true;  wait 2>/dev/null || true; git -C "$ROOT" worktree remove --force "$WT"; }
serve() { (cd "$1" && PYTHONPATH="$1" exec "$PY" -m server serve --host 127.0.0.1 --port "$2" --log-level warning) \
  > "$OUT/server-$2.log" 2>&1 & }
B=; A=; trap cleanup EXIT
# start-up: each server alone, STARTS times in turn, seconds from the process start to its first chat answer
for i in $(seq "${STARTS:-3}"); do
  for side in before after; do
    dir=$ROOT; [ $side = before ] && dir=$WT
    t0=$(date +%s.%N); serve "$dir" 18103; pid=$!
    for _ in $(seq 1200); do curl -sf localhost:18103/health > /dev/null && break; sleep 0.1; done
    curl -sf localhost:18103/v1/chat/completions -H 'content-type: application/json' \
      -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}' > /dev/null
    echo "$side $(echo "$(date +%s.%N) - $t0" | bc)" | tee -a "$OUT/starts.txt"
    kill $pid; wait $pid 2>/dev/null || true
  done
done
serve "$WT" 18101; B=$!; serve "$ROOT" 18102; A=$!
for port in 18101 18102; do
  for _ in $(seq 600); do curl -sf "localhost:$port/health" > /dev/null && break; sleep 0.5; done
done
bench() {  # bench NAME PORT ROUND
  "$PY" -m server bench --url "http://127.0.0.1:$2/v1" --endpoint chat --concurrency 1,4 --num-requests 8 \
    --prompt-tokens 64 --output-tokens 64 --warmup 2 --no-progress --out "$OUT/$1-r$3.json" | grep '^c=' | cut -c1-160
}
for r in $(seq "$ROUNDS"); do
  if (( r % 2 )); then bench before 18101 $r; bench after 18102 $r; else bench after 18102 $r; bench before 18101 $r; fi
done
"$PY" - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def runs(name):
    per = {}
    for r in range(1, rounds + 1):
        for run in json.load(open(f"{out}/{name}-r{r}.json"))["runs"]:
            s = run["summary"]
            per.setdefault(run["key"], []).append((s["output_tokens_per_s"], s["ttft"]["p50_ms"], s["itl"]["p50_ms"]))
    return per
b, a = runs("before"), runs("after")
summary = {}
for key in b:
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    summary[key] = {m: round(med(a[key], i) / med(b[key], i), 3) for i, m in enumerate(("tok_s", "ttft_p50", "itl_p50"))}
    summary[key]["before"] = [round(med(b[key], i), 2) for i in range(3)]
    summary[key]["after"] = [round(med(a[key], i), 2) for i in range(3)]
starts = {}
for line in open(f"{out}/starts.txt"):
    side, sec = line.split()
    starts.setdefault(side, []).append(float(sec))
if starts:
    summary["start_s"] = {side: round(statistics.median(v), 2) for side, v in starts.items()}
    summary["start_s"]["ratio"] = round(summary["start_s"]["after"] / summary["start_s"]["before"], 3)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print("after/before (medians of rounds):", json.dumps(summary))
PY
