#!/usr/bin/env bash
# The twin against the KV tiers benchmark: `pdserve sim` runs the workload and
# topologies of scripts/bench-kv-tiers.sh (pool only, a host tier, a small host tier
# over a disk tier) on a profile, and the table sets each beside what
# bench-kv-tiers.sh measured in REAL_DIR. See docs/bench/twin.md ("The twin with KV
# tiers").
#   scripts/twin-tiers.sh PROFILE REAL_DIR OUT_DIR
#   SECONDS_PER_POINT=120  CONCURRENCY=2  (as the measurement was run)
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:?usage: scripts/twin-tiers.sh PROFILE REAL_DIR OUT_DIR}
real=${2:?usage: scripts/twin-tiers.sh PROFILE REAL_DIR OUT_DIR}
out=${3:?usage: scripts/twin-tiers.sh PROFILE REAL_DIR OUT_DIR}
secs="${SECONDS_PER_POINT:-120}"
c="${CONCURRENCY:-2}"
workload="${WORKLOAD:---shared-prefixes 16 --prefix-len 1024 --prefix-order cycle --input-len 32..96 --output-len 16}"
mkdir -p "$out"
disk=target/twin-tiers-disk
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve

source scripts/kv-tiers-rows.sh
for cfg in $configs; do
  rm -rf "$disk"
  # shellcheck disable=SC2086  # the tier flags and the workload are lists of flags
  "$bin" sim --profile "$profile" "${base[@]}" ${tiers[$cfg]} --concurrency "$c" $workload --seed 11 \
    --seconds "$secs" --requests 1000000 --slo-ttft-ms 1000 --slo-tpot-ms 200 --out "$out/$cfg.json" >&2
done
rm -rf "$disk"

python3 - "$real" "$out" $configs <<'PY'
import json, sys
real, sim, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
def summary(d, c):
    return json.load(open(f"{d}/{c}.json"))["points"][0]["summary"]
def err(s, r):
    return f"{100 * (s - r) / r:+.0f} %" if r else "-"
print("| tiers | requests: measured | simulated | TTFT p50 ms: measured | simulated | error | "
      "TTFT p99 ms: measured | simulated | goodput req/s: measured | simulated | error |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for c in configs:
    r, s = summary(real, c), summary(sim, c)
    rt, st = r["ttft_ms"], s["ttft_ms"]
    print(f'| {c} | {r["requests"]} | {s["requests"]} | {rt["p50"]:.0f} | {st["p50"]:.0f} | {err(st["p50"], rt["p50"])} | '
          f'{rt["p99"]:.0f} | {st["p99"]:.0f} | {r["goodput"]:.3f} | {s["goodput"]:.3f} | {err(s["goodput"], r["goodput"])} |')
PY
