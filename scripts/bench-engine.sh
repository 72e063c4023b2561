#!/usr/bin/env bash
# pdserve's engine next to llama.cpp on the same GGUF, same machine, same run.
# Prints a ratio table and writes bench-results/engine-*.{json,md}.
# Usage: scripts/bench-engine.sh [threads list, default 1,2]
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${1:-1,2}"
out=bench-results; mkdir -p "$out"
peer=$(scripts/build-peer.sh)
cargo build --release --bin pdserve >&2
model=$(./target/release/pdserve pull)

echo "== pdserve" >&2
./target/release/pdserve bench engine --threads "$threads" --reps 2 --out "$out/engine-pdserve.json" >&2

echo "== llama.cpp: llama-bench" >&2
"$peer/llama-bench" -m "$model" -p 128,512,2048 -n 128 -t "$threads" -r 3 -o json > "$out/engine-llama-bench.json"

echo "== llama.cpp: llama-batched-bench" >&2
: > "$out/engine-llama-batched.jsonl"
for t in ${threads//,/ }; do
  "$peer/llama-batched-bench" -m "$model" -c 21000 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,4,16,32 \
    -t "$t" -tb "$t" --output-format jsonl 2>/dev/null | grep '^{' | sed "s/^{/{\"threads\": $t, /" >> "$out/engine-llama-batched.jsonl"
done

python3 scripts/bench_engine_report.py "$out" | tee "$out/engine-report.md"
