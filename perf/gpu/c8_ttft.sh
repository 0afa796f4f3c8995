#!/usr/bin/env bash
# Where 8 streams' TTFT goes: one CUDA server (--max-batch 8), 8 streams from 1, 2 and 4 client processes, the
# client's TTFT beside the server's own (/metrics: time to first token and queue time, the runs' deltas); then one
# stream on a --max-batch 1 server for the ratio. After .device/setup-cuda.sh:
#   bash perf/gpu/c8_ttft.sh   -> $OUT/c8_ttft/*.json and the lines on stdout
set -o pipefail
OUT=${OUT:-/tmp/ortserve_gpu_out}/c8_ttft; mkdir -p "$OUT"
[ -f /tmp/ortserve-1b/genai_config.json ] || OUT=$OUT/build PROVIDER=cuda bash perf/gpu/serving.sh build >/dev/null 2>&1
serve() {  # serve SLOTS PORT
  setsid python3 -m server serve --model /tmp/ortserve-1b --provider cuda --max-model-len 1024 --max-batch "$1" \
    --port "$2" --log-level warning --speculative-tokens 0 > "$OUT/server-$1.log" 2>&1 &
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$2/health" >/dev/null && return 0; sleep 0.5; done
}
b() {  # b PORT STREAMS REQUESTS PROCS NAME
  timeout 120 python3 -m server bench --url "http://127.0.0.1:$1/v1" --endpoint completions --no-progress \
    --extra-body '{"logprobs": 0}' --prompt-tokens 25 --output-tokens 128 --concurrency "$2" --num-requests "$3" \
    --warmup 0 --client-processes "$4" --out "$OUT/$5.json" > /dev/null 2>&1
  python3 - "$OUT/$5.json" "$5" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["runs"][0]["summary"]
print(f"{sys.argv[2]}: {s['output_tokens_per_s']:.0f} tok/s, client TTFT p50 {s['ttft']['p50_ms']:.1f} ms, "
      f"TPOT p50 {s['tpot']['p50_ms']:.2f} ms")
PY
}
server_side() {  # server_side BEFORE AFTER: the server's mean TTFT and queue time over the run
  python3 - "$1" "$2" <<'PY'
import sys
def read(path):
    out = {}
    for line in open(path):
        if line.startswith(("ortserve_time_to_first_token_seconds_", "ortserve_request_queue_time_seconds_")):
            name, value = line.rsplit(maxsplit=1)
            name = name.split("{")[0]  # summed over model_name
            if name.endswith(("_sum", "_count")):
                out[name] = out.get(name, 0.0) + float(value)
    return out
a, b = read(sys.argv[1]), read(sys.argv[2])
d = {k: b[k] - a.get(k, 0.0) for k in b}
n = d.get("ortserve_time_to_first_token_seconds_count", 0) or 1
print(f"   server: TTFT mean {1e3 * d.get('ortserve_time_to_first_token_seconds_sum', 0) / n:.1f} ms, queue mean "
      f"{1e3 * d.get('ortserve_request_queue_time_seconds_sum', 0) / n:.1f} ms over {n:.0f} requests")
PY
}
serve 8 8208
b 8208 8 16 1 warm > /dev/null
for procs in 1 2 4; do
  curl -s http://127.0.0.1:8208/metrics > "$OUT/before.txt"
  b 8208 8 64 "$procs" "c8-p$procs"
  curl -s http://127.0.0.1:8208/metrics > "$OUT/after.txt"
  server_side "$OUT/before.txt" "$OUT/after.txt"
done
pkill -f "port 8208"; sleep 2
serve 1 8201
b 8201 1 2 1 warm1 > /dev/null
b 8201 1 8 1 b1-c1
pkill -f "port 8201"; rm -f "$OUT/before.txt" "$OUT/after.txt"
