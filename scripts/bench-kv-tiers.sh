#!/usr/bin/env bash
# KV tiers: requests that share one of many system prompts, more of them than a
# worker's pool holds, against `pdserve serve --mode aggregated --workers 1` with no
# lower tier, with a host-RAM tier that holds them all, and with a small host tier
# over a disk tier. Same workload (seeded) on a fresh server each. Reports TTFT,
# goodput, the cached prompt tokens by tier and the router's predicted vs realized
# hits. The prefixes are taken in turn, so each comes back only after the other 15,
# an LRU pool's worst case. See docs/bench/kv-tiers.md.
#   OUT=bench-results/kv-tiers  SECONDS_PER_POINT=120  CONCURRENCY=2
#   WORKLOAD="--shared-prefixes 16 --prefix-len 1024 --prefix-order cycle --input-len 32..96 --output-len 16"
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${SECONDS_PER_POINT:-120}"
c="${CONCURRENCY:-2}"
workload="${WORKLOAD:---shared-prefixes 16 --prefix-len 1024 --prefix-order cycle --input-len 32..96 --output-len 16}"
out="${OUT:-bench-results/kv-tiers}"; mkdir -p "$out"
disk=target/bench-kv-tiers-disk
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
port=18096
source scripts/fresh-server.sh

source scripts/kv-tiers-rows.sh
for cfg in $configs; do
  echo "== $cfg" >&2
  rm -rf "$disk"
  # shellcheck disable=SC2086  # the tier flags are a list
  start_server "$out/$cfg.server.log" "${base[@]}" ${tiers[$cfg]}
  # shellcheck disable=SC2086  # the workload is a list of flags
  "$bin" bench load --url "http://127.0.0.1:$port" --concurrency "$c" $workload --seed 11 \
    --seconds "$secs" --requests 1000000 --slo-ttft-ms 1000 --slo-tpot-ms 200 --out "$out/$cfg.json" >&2
  stop_server
done
rm -rf "$disk"

python3 - "$out" $configs <<'PY'
import json, sys
out, configs = sys.argv[1], sys.argv[2:]
print("| tiers | requests | TTFT p50 ms | TTFT p99 ms | goodput req/s | prompt tokens | cached: pool | host | disk | none (computed) | realized/predicted |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for c in configs:
    s = json.load(open(f"{out}/{c}.json"))["points"][0]["summary"]
    h = s.get("prefix_hits") or {}
    prompt = s["input_token_throughput"] * s["duration_s"]
    real, host, disk = h.get("realized", 0), h.get("from_host", 0), h.get("from_disk", 0)
    pool = real - host - disk
    pct = lambda x: f"{100 * x / prompt:.0f} %" if prompt else "-"
    rp = f'{100 * real / h["predicted"]:.1f} %' if h.get("predicted") else "-"
    t = s["ttft_ms"]
    print(f'| {c} | {s["requests"]} | {t["p50"]:.0f} | {t["p99"]:.0f} | {s["goodput"]:.3f} | {prompt:.0f} | '
          f'{pct(pool)} | {pct(host)} | {pct(disk)} | {pct(prompt - real)} | {rp} |')
PY
