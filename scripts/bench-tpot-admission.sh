#!/usr/bin/env bash
# TPOT admission against none: `pdserve serve` (default topology) offered more
# decode work than it can pace within the objective, once without and once with
# `--admit-tpot-ms`; `bench load` reports TPOT and goodput at the same SLO.
#   usage: scripts/bench-tpot-admission.sh OUT_DIR
#   (RATE=4 SECONDS_PER_POINT=40 TPOT_MS=40 TTFT_MS=2000)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: $0 OUT_DIR}"
rate="${RATE:-4}" secs="${SECONDS_PER_POINT:-40}" tpot="${TPOT_MS:-40}" ttft="${TTFT_MS:-2000}"
mkdir -p "$dir"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
for way in off on; do
  case $way in
    off) admit=() ;;
    on) admit=(--admit-tpot-ms "$tpot") ;;
  esac
  "$bin" serve --port 18101 "${admit[@]}" >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 100); do curl -sf http://127.0.0.1:18101/health >/dev/null && break; sleep 0.2; done
  "$bin" bench load --url http://127.0.0.1:18101 --rate "$rate" --input-len 128 --output-len 128 \
    --seconds "$secs" --slo-ttft-ms "$ttft" --slo-tpot-ms "$tpot" --out "$dir/$way.json" >"$dir/$way.md" 2>/dev/null
  kill $pid; wait $pid 2>/dev/null || true
  echo "TPOT admission $way:"; tail -1 "$dir/$way.md"
done
