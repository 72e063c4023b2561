#!/usr/bin/env bash
# The planner against fixed roles on this machine's two real workers (one thread
# each), over one shifting workload played by `bench load --phase`: decode-heavy
# 128/512, prefill-heavy 2048/32, balanced 512/128, long prompts 1024/128 (each
# PHASE_SECONDS), then a sine between 2048/32 and 128/512 of period PHASE_SECONDS
# for twice as long; the same phases as scripts/bench-planner-sim.sh at SCALE=1.
# Every topology gets the same requests (one seed) on a fresh server:
#   planner    = serve --mode auto --workers 2 --planner
#   auto-2M    = serve --mode auto --workers 2             (auto over two mixed workers)
#   fixed-1P1D = serve --mode auto --prefill 1 --decode 1  (a dedicated split)
# scripts/planner_report.py makes the table: goodput and SLO attainment per phase
# and overall, role switches, failed requests, and the oracle (the best fixed
# topology of each phase). See docs/bench/planner.md.
#   usage: scripts/bench-planner.sh [OUT]   (PHASE_SECONDS=60 TOPOLOGIES="planner auto-2M fixed-1P1D")
# SCALE multiplies every rate and TTFT_MS / TPOT_MS set the SLOs, to fit a slower
# machine (e.g. SCALE=0.5 TTFT_MS=10000 TPOT_MS=20 at half the speed). PROTECT_TPOT=1
# gives every topology `serve --protect-tpot` with those SLOs.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/planner}"; mkdir -p "$out"
secs="${PHASE_SECONDS:-60}"
read -r -a tops <<<"${TOPOLOGIES:-planner auto-2M fixed-1P1D}"
source scripts/planner-phases.sh "$secs" "${SCALE:-1}"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
port=18091
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0; sleep 0.2; done; return 1; }

slo=(); [ "${PROTECT_TPOT:-0}" = 1 ] && slo=(--protect-tpot --slo-ttft-ms $ttft --slo-tpot-ms $tpot)
for t in "${tops[@]}"; do
  case $t in
    planner) args=(--workers 2 --planner --slo-ttft-ms $ttft --slo-tpot-ms $tpot ${slo[@]:+--protect-tpot}) ;;
    auto-2M) args=(--workers 2 ${slo[@]+"${slo[@]}"}) ;;
    fixed-1P1D) args=(--prefill 1 --decode 1 ${slo[@]+"${slo[@]}"}) ;;
    *) echo "unknown topology $t" >&2; exit 2 ;;
  esac
  echo "== $t: serve --mode auto ${args[*]}" >&2
  RUST_LOG=info "$bin" serve --port $port --mode auto --max-queue-seconds 0 "${args[@]}" >"$out/$t.server.log" 2>&1 &
  pid=$!; wait_up
  "$bin" bench load --url "http://127.0.0.1:$port" "${phases[@]}" --timeout-seconds 600 --seed 7 \
    --slo-ttft-ms $ttft --slo-tpot-ms $tpot --out "$out/$t.json" >"$out/$t.md"
  curl -s "http://127.0.0.1:$port/metrics" >"$out/$t.metrics"
  kill $pid; wait $pid 2>/dev/null || true
done
python3 scripts/planner_report.py "$out" "${tops[@]}" | tee "$out/report.md"
