#!/usr/bin/env bash
# The quantized KV cache's speed and capacity (docs/bench/kv-cache.md), in one run:
#   1. decode tok/s of one sequence after 4,096 and 8,128 prompt tokens (8,192 with the
#      64 generated: the default model's context), per cache dtype,
#      pdserve next to llama.cpp's llama-bench (-d, flash attention on, -ctk/-ctv);
#   2. the K/V of a 2,048-token prompt of the default model moved over loopback TCP and
#      shared memory, per dtype, and over TCP through a 20 Mbit/s token bucket (the
#      multi-host suite's slow link) in a network namespace;
#   3. a fixed KV memory budget (8 GB) at 64 concurrent 2,048-token requests, on the
#      twin of an H100 serving Llama-3.1-8B, per dtype;
#   4. the same on real workers: `pdserve serve` with 0.2 GB of KV, 16 clients sending
#      32 requests of 2,048 prompt tokens and 256 out, admission control off so every
#      request waits for room instead of being refused.
# Quality (perplexity, greedy agreement) is measured by the commands in docs/models.md.
#
# Usage: scripts/bench-kv-cache.sh [MODEL]   (default: the default model)
#   THREADS=n   compute threads (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench-results/kv-cache
mkdir -p "$out"
cargo build --release --bin pdserve >&2
pdserve=./target/release/pdserve
model=${1:-$("$pdserve" pull 2>/dev/null)}
bin=$(scripts/build-peer.sh)
threads=${THREADS:-2}
echo "== decode at depth: pdserve (tok/s)"
for d in f16 q8_0 q4_0; do
  for depth in 4096 8128; do
    "$pdserve" bench engine --model "$model" --threads "$threads" --prefill 16 --batch 1 --decode-prompt "$depth" \
      --decode-tokens 64 --reps 2 --kv-cache-dtype "$d" --out "$out/decode-$d-$depth.json" 2>/dev/null \
      | awk -v d="$d" -v depth="$depth" '/prompt='"$depth"'/ {print d, depth, $(NF-1)}'
  done
done
echo "== decode at depth: llama.cpp (tok/s)"
for d in f16 q8_0 q4_0; do
  "$bin/llama-bench" -m "$model" -p 0 -n 64 -d 4096,8128 -t "$threads" -r 1 -fa 1 -ctk "$d" -ctv "$d" -o json \
    > "$out/llama-bench-$d.json" 2>/dev/null
  python3 -c 'import json,sys; [print(sys.argv[2], r["n_depth"], round(r["avg_ts"],1)) for r in json.load(open(sys.argv[1]))]' \
    "$out/llama-bench-$d.json" "$d"
done
echo "== a 2,048-token prompt's K/V over each transport"
cargo test --release -q -p pdserve-kv-transfer --test transports a_prompts_handoff_per_dtype_is_measurable \
  -- --nocapture 2>&1 | grep tokens
echo "== the same over a 20 Mbit/s link (the multi-host suite's token bucket, one run each; needs root)"
bin_t=$(cargo test --release -p pdserve-kv-transfer --test transports --no-run 2>&1 | grep -o 'target/release/deps/transports-[0-9a-f]*')
ns=pdkvlink$$
ip netns add "$ns"
trap 'ip netns del "$ns" 2>/dev/null || true' EXIT
ip netns exec "$ns" ip link set lo mtu 1500 up
ip netns exec "$ns" tc qdisc add dev lo root tbf rate 20mbit burst 32kb latency 50ms
PDSERVE_HANDOFF_ROUNDS=1 ip netns exec "$ns" "$bin_t" a_prompts_handoff_per_dtype_is_measurable --nocapture 2>&1 \
  | grep '^tcp'
ip netns del "$ns"
echo "== 8 GB of KV, 64 concurrent 2,048-token requests, twin of an H100 with Llama-3.1-8B"
for d in f16 q8_0 q4_0; do
  echo "-- $d"
  "$pdserve" sim --profile profiles/h100-llama3.1-8b.json --mode aggregated --workers 1 --kv-cache-dtype "$d" \
    --kv-cache-gb 8 --concurrency 64 --input-len 2048 --output-len 256 --requests 384 --out "$out/sim-$d" 2>/dev/null \
    | grep -E '^\| (point|C=)'
done
echo "== 0.2 GB of KV on a real worker, 16 clients, 2,048 in / 256 out"
port=18093
for d in f16 q8_0 q4_0; do
  "$pdserve" serve --mode aggregated --port $port --kv-cache-gb 0.2 --kv-cache-dtype "$d" --max-queue-seconds 0 \
    > "$out/serve-$d.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
  python3 scripts/bench_serve.py --url "http://127.0.0.1:$port" --label "$d" --concurrency 16 --requests 32 \
    --isl 2048 --osl 256 --peaks | tee "$out/serve-$d.json"
  kill $pid; wait $pid 2>/dev/null || true
done
