#!/usr/bin/env bash
# pdserve serve (each mode) next to llama-server on the same GGUF and the same 2 cores:
# ISL 512 / OSL 128 random-token prompts, closed loop at concurrency 1..32.
# Writes bench-results/serve.jsonl and prints a ratio table.
set -euo pipefail
cd "$(dirname "$0")/.."
conc="${CONCURRENCY:-1,2,4,8,16,32}"
out=bench-results; mkdir -p "$out"; : > "$out/serve.jsonl"
peer=$(scripts/build-peer.sh)
cargo build --release --bin pdserve >&2
model=$(./target/release/pdserve pull)
port=18080

wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0; sleep 0.2; done; return 1; }

echo "== llama-server" >&2
"$peer/llama-server" -m "$model" -t 2 -tb 2 -np 16 -c 16384 -cb --no-cache-prompt --port $port >/dev/null 2>&1 &
pid=$!; wait_up
python3 scripts/bench_serve.py --url "http://127.0.0.1:$port" --label llama-server --concurrency "$conc" | tee -a "$out/serve.jsonl" >&2
kill $pid; wait $pid 2>/dev/null || true

for mode in ${MODES:-auto disaggregated aggregated}; do
  echo "== pdserve $mode" >&2
  ./target/release/pdserve serve --mode "$mode" --port $port --kv-blocks 2048 >/dev/null 2>&1 &
  pid=$!; wait_up
  python3 scripts/bench_serve.py --url "http://127.0.0.1:$port" --label "pdserve-$mode" --concurrency "$conc" | tee -a "$out/serve.jsonl" >&2
  kill $pid; wait $pid 2>/dev/null || true
done

python3 - "$out/serve.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peer = {r["concurrency"]: r for r in rows if r["label"] == "llama-server"}
print("| server | C | out tok/s | ratio | TTFT mean ms | TTFT p99 ms | TPOT mean ms | errors |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    p = peer.get(r["concurrency"])
    ratio = f'{r["output_tok_s"] / p["output_tok_s"]:.2f}×' if p and p["output_tok_s"] else "-"
    print(f'| {r["label"]} | {r["concurrency"]} | {r["output_tok_s"]:.1f} | {ratio} | {r["ttft_mean_ms"]:.0f} | '
          f'{r["ttft_p99_ms"]:.0f} | {r["tpot_mean_ms"]:.1f} | {r["errors"]} |')
PY
