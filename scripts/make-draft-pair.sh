#!/usr/bin/env bash
# Makes the draft-model pair the speculative benchmarks use (docs/speculative.md):
# SmolLM2-135M-Instruct in F16 as the target, made by llama.cpp's quantizer from the
# Q4_1 file `pdserve pull` fetches, which drafts for it. The two share the
# vocabulary and, up to the Q4_1 rounding the F16 copy keeps, the weights: the
# closest same-vocabulary pair this machine can make (no other SmolLM2 is fetchable).
# Prints the target's path.
set -euo pipefail
cd "$(dirname "$0")/.."
models="${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/models"
draft="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
target="$models/SmolLM2-135M-Instruct.F16-from-Q4_1.gguf"
if [ ! -s "$target" ]; then
  [ -s "$draft" ] || ./target/release/pdserve pull smollm2-135m >&2
  bin=$(scripts/build-peer.sh oracle | tail -1)
  "$bin/llama-quantize" --allow-requantize "$draft" "$target.part" F16 > "$target.log" 2>&1 \
    || { cat "$target.log" >&2; exit 1; }
  mv "$target.part" "$target"
fi
echo "$target"
