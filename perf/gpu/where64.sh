#!/usr/bin/env bash
# Where a 64-stream server's time goes, one CUDA server (--max-batch 64, --speculative-tokens 0), after
# .device/setup-cuda.sh and py-spy's wheel installed into /tmp/site:
#   - the engine's steps, rows per step and phases (/metrics before and after a run);
#   - each server thread's CPU seconds over that run (/proc/PID/task/*/stat);
#   - which thread holds the interpreter (py-spy record --gil) and where every thread is (py-spy --idle);
#   - the same run from 4 and 8 client processes (is the client the limit?), and one stream for the ratio.
#   bash perf/gpu/where64.sh   -> $OUT/where64/* (SERVE_ARGS adds server flags, TAG names the folder)
set -o pipefail
OUT=${OUT:-/tmp/ortserve_gpu_out}/where64${TAG:+-$TAG}; mkdir -p "$OUT"
[ -f /tmp/ortserve-1b/genai_config.json ] || OUT=$OUT/build PROVIDER=cuda bash perf/gpu/serving.sh build >/dev/null 2>&1
port=8199
setsid python3 -m server serve --model /tmp/ortserve-1b --provider cuda --max-model-len 1024 --max-batch 64 \
  --port $port --log-level warning --speculative-tokens 0 ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
spid=$!
for _ in $(seq 240); do
  curl -sf http://127.0.0.1:$port/health >/dev/null && break
  kill -0 $spid 2>/dev/null || { echo "server died"; tail -n 20 "$OUT/server.log"; exit 1; }
  sleep 0.5
done
pids=$(pgrep -f "port $port" | tr '\n' ' ')
pids="$pids $(for p in $pids; do pgrep -P "$p"; done | tr '\n' ' ')"  # the engine process (--engine-process)
b() {  # b STREAMS REQUESTS PROCS NAME
  timeout 150 python3 -m server bench --url http://127.0.0.1:$port/v1 --endpoint completions --no-progress \
    --extra-body "${BODY:-{\"logprobs\": 0\}}" --prompt-tokens 25 --output-tokens 128 --concurrency "$1" \
    --num-requests "$2" --warmup 0 --client-processes "$3" --out "$OUT/$4.json" 2>&1 | tail -n 1
}
threads() {  # every thread of the server's processes: pid tid comm utime+stime (ticks)
  for p in $pids; do for t in /proc/$p/task/*; do
    echo "$p $(basename "$t") $(tr -d '()' < "$t/comm" | tr ' ' _) $(awk '{print $14 + $15}' "$t/stat")"
  done; done
}
b 64 64 4 warm > /dev/null
curl -s http://127.0.0.1:$port/metrics > "$OUT/m0.txt"; threads > "$OUT/t0.txt"
echo "64 streams, 4 client processes: $(b 64 256 4 c64-p4)"
curl -s http://127.0.0.1:$port/metrics > "$OUT/m1.txt"; threads > "$OUT/t1.txt"
python3 -m perf.gpu.phases "$OUT/m0.txt" "$OUT/m1.txt" --out "$OUT/phases.json"
python3 - "$OUT" "$(getconf CLK_TCK)" <<'EOF'
import sys
from pathlib import Path
out, hz = Path(sys.argv[1]), int(sys.argv[2])
def read(p):
    return {(r[0], r[1]): (r[2], int(r[3])) for r in (line.split() for line in p.read_text().splitlines()) if len(r) == 4}
a, b = read(out / "t0.txt"), read(out / "t1.txt")
rows = sorted(((b[k][1] - a.get(k, (0, 0))[1]) / hz, b[k][0], k) for k in b)
total = sum(r[0] for r in rows)
print(f"server CPU over the run: {total:.2f} s; busiest threads:")
for s, comm, k in rows[::-1][:8]:
    print(f"  {comm:20s} pid {k[0]} tid {k[1]}: {s:.2f} s")
EOF
main=$(echo $pids | cut -d' ' -f1)
for kind in gil idle; do
  flag=--gil; [ $kind = idle ] && flag=--idle
  /tmp/site/bin/py-spy record -p "$main" -d 6 -r 250 -f raw $flag --nonblocking --threads \
    -o "$OUT/pyspy-$kind.txt" > "$OUT/pyspy-$kind.log" 2>&1 &
  spy=$!
  sleep 0.3; echo "64 streams under py-spy ($kind): $(b 64 192 4 c64-spy-$kind)"
  wait $spy
done
echo "64 streams, 8 client processes: $(b 64 256 8 c64-p8)"
echo "8 streams, 4 client processes: $(b 8 64 4 c8-p4)"
echo "one stream: $(b 1 8 1 c1)"
kill $spid; sleep 2; kill -9 $spid 2>/dev/null
python3 - "$OUT" <<'EOF'
import collections, re, sys
from pathlib import Path
out = Path(sys.argv[1])
for kind in ("gil", "idle"):
    p = out / f"pyspy-{kind}.txt"
    if not p.exists():
        continue
    by_thread, by_leaf, total = collections.Counter(), collections.Counter(), 0
    for line in p.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n); total += n
        frames = stack.split(";")
        by_thread[frames[0]] += n
        leaf = next((f for f in reversed(frames) if "site-packages" not in f and "/lib/python" not in f), frames[-1])
        by_leaf[(frames[0], re.sub(r"\s+", " ", leaf))] += n
    print(f"== py-spy {kind}: {total} samples")
    for t, n in by_thread.most_common(6):
        print(f"  {100 * n / total:5.1f}%  {t}")
    for (t, f), n in by_leaf.most_common(25):
        print(f"  {100 * n / total:5.1f}%  {t[:28]:28s} {f[:110]}")
EOF
grep -hE "^(vllm:prefix_cache|ortserve_generation_tokens_total|ortserve_engine_steps_total)" "$OUT/m0.txt" "$OUT/m1.txt"
