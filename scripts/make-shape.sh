#!/usr/bin/env bash
# Prints the path of a real-size Llama shape with random weights in Q4_K_M, making it
# on first use: scripts/random_gguf.py writes it in F16 and llama.cpp's llama-quantize
# (the oracle build of scripts/build-peer.sh) quantizes it. A dense model's speed does
# not depend on its weights' values.
#
# Usage: scripts/make-shape.sh 1b|8b
#   PDSERVE_BIN=path  the pdserve whose `pull` gives the tokenizer donor (default: the
#                     release build)
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1
f="target/shapes/llama-$name-Q4_K_M.gguf"
if [ ! -f "$f" ]; then
  mkdir -p target/shapes
  bin=$(scripts/build-peer.sh oracle)
  peer=$(dirname "$(dirname "$bin")")
  py=${PDSERVE_ORACLE_PYTHON:-target/test-venv/bin/python}
  "$py" -m pip install -q --disable-pip-version-check numpy tqdm pyyaml requests >&2
  pdserve=${PDSERVE_BIN:-./target/release/pdserve}
  src="target/shapes/llama-$name-f16.gguf"
  PYTHONPATH="$peer/src/vendor/llama.cpp/gguf-py" "$py" scripts/random_gguf.py llama "$name" "$src" \
    --donor "$("$pdserve" pull)" >&2
  "$bin/llama-quantize" "$src" "$f.part" Q4_K_M >&2
  mv "$f.part" "$f"
  rm -f "$src"
fi
echo "$f"
