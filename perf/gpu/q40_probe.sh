#!/usr/bin/env bash
# Issue 45, after issue45.sh peer-8b on a warm machine: the same Llama-3.1-8B shape in Q4_0 (every weight Q4_0, no
# Q4_K mins to carry) against llama-server, 1 and 8 streams, both servers with 8 slots of 4,096 tokens. Does the
# Q4_K_M gap come from the K-quants' extra offsets MatMul? Needs /root/peer from issue45.sh (build, vocab, tree).
set -uo pipefail
P=/root/peer; OUT=${OUT:-/tmp/q40_out}; mkdir -p "$OUT"; here=$PWD
[ -n "${SKIP_BUILD:-}" ] || ( cd $P/tree-model-8b && PYTHONPATH=$PWD/.peer/gguf-py:$PWD:${PYTHONPATH:-} python3 -m perf.gpu.bench_gguf \
    --vocab $P/vocab-llama-bpe.gguf --shape llama-3.1-8b --out $P/q40.gguf | tail -n 1 &&
  PYTHONPATH=$PWD/.peer/gguf-py:$PWD:${PYTHONPATH:-} python3 -c 'import sys; from engine.builder import convert_gguf
convert_gguf(sys.argv[1], sys.argv[2], accuracy_level=4, dtype="float16", overwrite=True, progress=False)' \
    $P/q40.gguf $P/q40 ) || exit 1
up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 0.25; done; return 1; }
b() { python3 -m server bench --url "http://127.0.0.1:$1/v1" --endpoint completions --no-progress --prompt-tokens 25 \
  --output-tokens 128 --concurrency "$3" --num-requests $(( $3 * 4 )) --warmup 1 --out "$OUT/$2-c$3.json" 2>&1 | grep -E "^c=" ; }
setsid python3 -m server serve --model $P/q40 --provider cuda --max-model-len 4096 --max-batch 8 --port 8400 \
  --speculative-tokens 0 > "$OUT/ours.log" 2>&1 & S=$!
up 8400 && { b 8400 q40-ours 1; b 8400 q40-ours 8; }; kill $S; sleep 2; kill -9 $S 2>/dev/null
[ -n "${SKIP_PEER:-}" ] && exit 0
setsid $P/build/bin/llama-server -m $P/q40.gguf -ngl 99 -np 8 -c 32768 -b 2048 -ub 512 --port 8401 > "$OUT/peer.log" 2>&1 & L=$!
up 8401 && { b 8401 q40-peer 1; b 8401 q40-peer 8; }; kill $L
