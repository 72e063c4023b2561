# Sourced by the benchmark scripts: one fresh `pdserve serve` per measurement.
#   start_server LOG ARGS...   starts it on $port (set by the caller), waits for /health
#   stop_server                stops it
# shellcheck shell=bash
start_server() {
  local log=$1; shift
  "$bin" serve --port "$port" "$@" >"$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0; sleep 0.2; done
  echo "the server did not come up; see $log" >&2
  return 1
}

stop_server() {
  kill "$server_pid"; wait "$server_pid" 2>/dev/null || true
}
