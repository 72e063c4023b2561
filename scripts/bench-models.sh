#!/usr/bin/env bash
# pdserve's engine next to llama.cpp at real size, same machine, same run: Gemma 3 270M
# (the real Q4_K_M file) and Llama-3.2-1B and Llama-3.1-8B shapes with random weights
# in Q4_K_M (scripts/random_gguf.py, quantized by llama.cpp's llama-quantize; a dense
# model's speed does not depend on its weights' values). At 1 and 2 threads: prefill
# pp512, decode tg128 (tg32 for the shapes), aggregate decode of 4 and 16 sequences after
# 64-token prompts, and decode as a share of the memory-read roofline measured in the
# same run. Writes bench-results/models/ and prints the tables of docs/bench/models.md.
#
# Usage: scripts/bench-models.sh [model ...]   (default: gemma3-270m 1b 8b)
#   PDSERVE_BIN=path  use this pdserve instead of building the release binary
#   REPS=n            repetitions of each measurement (default 2; the best is kept)
#   GEN=n             tokens generated per sequence (default 128 for gemma3-270m, 32
#                     for the shapes, whose 16-sequence runs would take many minutes)
#   BATCH=list        aggregate-decode batch sizes (default 4,16)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench-results/models
mkdir -p "$out" target/shapes
bin=$(scripts/build-peer.sh)
py=${PDSERVE_ORACLE_PYTHON:-target/test-venv/bin/python}
pdserve=${PDSERVE_BIN:-}
if [ -z "$pdserve" ]; then
  cargo build --release --bin pdserve >&2
  pdserve=./target/release/pdserve
fi

# The Q4_K_M file of a Llama shape, made on first use.
shape() { PDSERVE_BIN=$pdserve scripts/make-shape.sh "$1"; }

models=("$@")
[ ${#models[@]} -gt 0 ] || models=(gemma3-270m 1b 8b)
for name in "${models[@]}"; do
  case $name in
    gemma3-270m) model=$("$pdserve" pull gemma3-270m) ;;
    *) model=$(shape "$name") ;;
  esac
  gen=${GEN:-}
  [ -n "$gen" ] || { [ "$name" = gemma3-270m ] && gen=128 || gen=32; }
  reps=${REPS:-2}
  batch=${BATCH:-4,16}
  echo "== $name: pdserve" >&2
  "$pdserve" bench engine --model "$model" --threads 1,2 --prefill 512 --batch "$batch" --decode-prompt 64 \
    --decode-tokens "$gen" --reps "$reps" --out "$out/$name-pdserve.json" >&2
  echo "== $name: llama.cpp" >&2
  "$bin/llama-bench" -m "$model" -p 512 -n "$gen" -t 1,2 -r "$reps" -o json > "$out/$name-llama-bench.json"
  : > "$out/$name-llama-batched.jsonl"
  for t in 1 2; do
    "$bin/llama-batched-bench" -m "$model" -c 4096 -b 2048 -ub 512 -npp 64 -ntg "$gen" -npl "$batch" \
      -t "$t" -tb "$t" --output-format jsonl 2>/dev/null | grep '^{' | sed "s/^{/{\"threads\": $t, /" \
      >> "$out/$name-llama-batched.jsonl"
  done
  "$py" -c "
import sys, json
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
names = {t.name for t in r.tensors}
# What one decode step reads: every weight but the embedding table, which is looked up
# row by row, unless it is also the output projection.
b = sum(int(t.n_bytes) for t in r.tensors if t.name != 'token_embd.weight' or 'output.weight' not in names)
json.dump({'file': sys.argv[1], 'decode_weight_bytes': b}, open(sys.argv[2], 'w'))
" "$model" "$out/$name-file.json"
done
"$py" scripts/bench_models_report.py "$out" "${models[@]}" | tee "$out/report.md"
