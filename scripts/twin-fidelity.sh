#!/usr/bin/env bash
# The twin's fidelity: measures each topology × workload × concurrency with
# `pdserve bench load` against `pdserve serve`, simulates the same with `pdserve sim`
# from a profile timed first on this machine, and tabulates the errors
# (scripts/twin_fidelity.py). Nothing else should run on the machine meanwhile.
#
#   scripts/twin-fidelity.sh [OUT_DIR]     (default docs/bench-results/<today>/twin)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench-results/$(date -u +%F)/twin}
mkdir -p "$OUT"
BIN=target/release/pdserve
cargo build --release --bin pdserve
PORT=${PORT:-8431}
REQUESTS=${REQUESTS:-16}
CONC=${CONC:-1,4,8}

[ -f "$OUT/profile.json" ] || "$BIN" profile --threads 1,2 --out "$OUT/profile.json"

# name | serve/sim topology flags
TOPOLOGIES=(
  "agg1|--mode aggregated --workers 1"
  "agg2|--mode aggregated --workers 2"
  "1P1D|--mode disaggregated --prefill 1 --decode 1"
  "auto2M|--mode auto --workers 2"
)
# name | workload flags
WORKLOADS=(
  "chat|--input-len 512 --output-len 128"
  "long-prompt|--input-len 1024 --output-len 32"
  "long-answer|--input-len 128 --output-len 256"
)

for t in "${TOPOLOGIES[@]}"; do
  tname=${t%%|*}; tflags=${t#*|}
  for w in "${WORKLOADS[@]}"; do
    wname=${w%%|*}; wflags=${w#*|}
    base="$OUT/$tname-$wname"
    # shellcheck disable=SC2086
    "$BIN" sim --profile "$OUT/profile.json" $tflags $wflags --concurrency "$CONC" \
      --requests "$REQUESTS" --out "$base.sim.json" > /dev/null
    [ -f "$base.real.json" ] && continue
    # shellcheck disable=SC2086
    "$BIN" serve $tflags --port "$PORT" > "$base.serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.2; done
    # shellcheck disable=SC2086
    "$BIN" bench load --url "http://127.0.0.1:$PORT" $wflags --concurrency "$CONC" \
      --requests "$REQUESTS" --out "$base.real.json" > /dev/null
    kill "$pid"; wait "$pid" || true
    rm -f "$base.serve.log"
  done
done
python3 scripts/twin_fidelity.py "$OUT" | tee "$OUT/fidelity.md"
