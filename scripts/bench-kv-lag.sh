#!/usr/bin/env bash
# KV index lag with events pushed over NATS (a fleet) against polled over control (a
# listed worker set): two simulated workers on PROFILE, a kv-aware frontend, 30 s of
# shared-prefix load; prints the frontend's lag histogram as mean / p50 / p99 bounds.
#   usage: scripts/bench-kv-lag.sh PROFILE   (SECONDS_PER_POINT=30)
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:?usage: $0 PROFILE}"
secs="${SECONDS_PER_POINT:-30}"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
nats=$(scripts/nats.sh install)
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT
"$nats" -js -sd "$out/nats" -a 127.0.0.1 -p 14299 >/dev/null 2>&1 &
url=nats://127.0.0.1:14299
sleep 0.5
for i in 1 2; do
  "$bin" worker --engine sim --profile "$profile" --role mixed --listen "127.0.0.1:1730$i" --nats "$url" \
    --node-id "lag-$i" --insecure >"$out/w$i.log" 2>&1 &
done
sleep 1
for mode in pushed polled; do
  case $mode in
    pushed) fe=(--nats "$url") ;;
    polled) fe=(--workers 127.0.0.1:17301,127.0.0.1:17302) ;;
  esac
  "$bin" frontend "${fe[@]}" --mode aggregated --policy kv-aware --port 18099 --insecure >"$out/fe.log" 2>&1 &
  pid=$!
  sleep 3
  "$bin" bench load --url http://127.0.0.1:18099 --concurrency 4 --shared-prefixes 8 --prefix-len 512 --prefix-order cycle \
    --input-len 64 --output-len 16 --seconds "$secs" --requests 1000000 --warmup 0 >/dev/null 2>&1
  curl -s http://127.0.0.1:18099/metrics | grep -E "^pdserve_kv_index_(lag_seconds|pushed)" >"$out/$mode.txt"
  kill $pid; wait $pid 2>/dev/null || true
done
python3 - "$out" <<'PY'
import sys
print("| events reach the index | events | pushed | mean lag ms | p50 ≤ ms | p99 ≤ ms |")
print("|---|---|---|---|---|---|")
for mode in ["pushed", "polled"]:
    buckets, total, count, pushed = [], 0.0, 0.0, 0.0
    for line in open(f"{sys.argv[1]}/{mode}.txt"):
        name, val = line.rsplit(" ", 1)
        if "_bucket" in name:
            le = name.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(val)))
        elif name.endswith("_sum"):
            total = float(val)
        elif name.endswith("_count"):
            count = float(val)
        elif "pushed" in name:
            pushed = float(val)
    q = lambda p: next(le for le, v in buckets if v >= p * count) * 1e3
    mean = 1e3 * total / count if count else float("nan")
    print(f"| {mode} | {count:.0f} | {pushed:.0f} | {mean:.1f} | {q(0.5):.0f} | {q(0.99):.0f} |")
PY
