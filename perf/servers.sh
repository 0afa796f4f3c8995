# Sourced by perf's comparison scripts (after they define `log`): the servers they start go into PIDS and are
# stopped on exit (resumed first, should one be paused with SIGSTOP); wait_ready URL PID waits for one to answer.
PIDS=()
stop_servers() {
  local pid
  for pid in "${PIDS[@]}"; do
    kill -CONT "$pid" 2>/dev/null || true
    if kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  done
}
trap stop_servers EXIT
wait_ready() {  # wait_ready URL PID: until GET URL/models answers 2xx and /health (beside URL's /v1) is not 503
  # (ortserve --engine-process lists its model before the engine process is ready), at most 600 s
  local url=$1 pid=$2 i
  for ((i = 0; i < 1200; i++)); do
    if curl -sf "$url/models" > /dev/null \
        && [ "$(curl -s -o /dev/null -w '%{http_code}' "${url%/v1}/health")" != 503 ]; then return 0; fi
    kill -0 "$pid" 2>/dev/null || { log "server for $url exited before it was ready"; return 1; }
    sleep 0.5
  done
  log "server for $url not ready after 600 s"; return 1
}
