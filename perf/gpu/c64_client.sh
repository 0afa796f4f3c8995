#!/usr/bin/env bash
# Is 64 streams' throughput the server's or the bench client's limit? One CUDA server (--max-batch 64), then:
# one client process with 64 streams (its CPU time and the server's, from /proc), two client processes of 32 streams
# each at once (aggregate), and one client with no logprobs in the requests. After .device/setup-cuda.sh:
#   bash perf/gpu/c64_client.sh   -> $OUT/c64_client/*.json and the log on stdout
set -o pipefail
OUT=${OUT:-/tmp/ortserve_gpu_out}/c64_client; mkdir -p "$OUT"
[ -f /tmp/ortserve-1b/genai_config.json ] || OUT=$OUT/build PROVIDER=cuda bash perf/gpu/serving.sh build >/dev/null 2>&1
setsid python3 -m server serve --model /tmp/ortserve-1b --provider cuda --max-model-len 1024 --max-batch 64 --port 8199 \
  --log-level warning --speculative-tokens 0 ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
for _ in $(seq 240); do curl -sf http://127.0.0.1:8199/health >/dev/null && break; sleep 0.5; done
pid=$(pgrep -f "port 8199" | head -n 1)
b() {  # b STREAMS REQUESTS NAME [BODY]
  timeout 120 python3 -m server bench --url http://127.0.0.1:8199/v1 --endpoint completions --no-progress \
    --extra-body "${4:-{\"logprobs\": 0\}}" --prompt-tokens 25 --output-tokens 128 --concurrency "$1" \
    --num-requests "$2" --warmup 0 --out "$OUT/$3.json" 2>&1 | tail -n 1
}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }  # utime + stime, clock ticks
hz=$(getconf CLK_TCK)
b 64 64 warm > /dev/null
s0=$(ticks "$pid"); TIMEFORMAT="client cpu %U user + %S sys s, wall %R s"
time { echo "one client, 64 streams: $(b 64 192 one)"; }
s1=$(ticks "$pid"); echo "server cpu $(( (s1 - s0) * 1000 / hz )) ms over that run"
time { b 32 96 twoA > "$OUT/twoA.txt" & b 32 96 twoB > "$OUT/twoB.txt" & wait; }
echo "two clients of 32 streams at once: $(cat "$OUT/twoA.txt")"; echo "   and $(cat "$OUT/twoB.txt")"
s2=$(ticks "$pid"); echo "server cpu $(( (s2 - s1) * 1000 / hz )) ms over that run"
echo "one client, 64 streams, no logprobs: $(b 64 192 plain '{}')"
kill "$pid"; sleep 2; kill -9 "$pid" 2>/dev/null
