#!/usr/bin/env bash
# The planner under constant load on this machine's real workers: `pdserve serve
# --mode auto --workers 2 --planner` (one thread each) offered a constant Poisson
# load for SECONDS; counts the planner's role switches (the no-oscillation check:
# at most one per 10 minutes).
#   usage: scripts/planner-constant-real.sh OUT_DIR
#   (SECONDS_TOTAL=1800 RATE=0.5 INPUT=512 OUTPUT=128 TTFT_MS=5000 TPOT_MS=50)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: $0 OUT_DIR}"; mkdir -p "$dir"
secs="${SECONDS_TOTAL:-1800}" rate="${RATE:-0.5}" isl="${INPUT:-512}" osl="${OUTPUT:-128}"
ttft="${TTFT_MS:-5000}" tpot="${TPOT_MS:-50}"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
RUST_LOG=info "$bin" serve --port 18102 --mode auto --workers 2 --planner --slo-ttft-ms "$ttft" \
  --slo-tpot-ms "$tpot" >"$dir/serve.log" 2>&1 &
pid=$!
for _ in $(seq 100); do curl -sf http://127.0.0.1:18102/health >/dev/null && break; sleep 0.2; done
"$bin" bench load --url http://127.0.0.1:18102 --rate "$rate" --input-len "$isl" --output-len "$osl" \
  --seconds "$secs" --requests 1000000 --slo-ttft-ms "$ttft" --slo-tpot-ms "$tpot" --out "$dir/load.json" \
  >"$dir/load.md" 2>/dev/null
curl -s http://127.0.0.1:18102/metrics | grep -E "^pdserve_(planner_decisions_total|worker_role)" >"$dir/planner-metrics.txt" || true
kill $pid; wait $pid 2>/dev/null || true
grep -E "switching roles|role switched|decodes finished|handed back" "$dir/serve.log" >"$dir/switches.log" || true
echo "switches: $(grep -c 'switching roles' "$dir/switches.log" || true) in $secs s"
tail -1 "$dir/load.md"
