#!/usr/bin/env bash
# Makes the files the architecture and quantization tests compare pdserve with, and
# llama.cpp's logits on them (crates/engine/tests/peer_oracle.rs reads the result):
#
# - a random-weight model in each architecture whose real weights cannot be fetched
#   here (scripts/random_gguf.py, tiny shapes, F16), quantized to Q4_K_M and Q8_0 by
#   llama.cpp's own llama-quantize;
# - SmolLM2-135M re-quantized by llama-quantize into the K, legacy and IQ4 types
#   (--allow-requantize: its rows of 576 are not whole 256-value blocks, so some
#   tensors fall back to other types exactly as in files on the Hub);
# - for each file, llama.cpp's logits at every position of a fixed token sequence
#   (scripts/peer_logits.py), and target/oracle/oracle.json listing them;
# - the default model's embeddings of that sequence's text tokens, mean and
#   last-token pooled (scripts/peer_embeddings.py, crates/engine/tests/embeddings.rs);
# - the tokenizer test vocabularies llama.cpp keeps (Llama 3's BPE, Qwen 2/3's, Phi-3's
#   SentencePiece) with their texts and expected ids, in target/oracle/vocab
#   (crates/engine/tests/tokenizer_vocabs.rs);
# - SmolLM2 split by llama.cpp's llama-gguf-split into 3 parts and into 2, in
#   target/oracle/split (crates/engine/tests/split_gguf.rs);
# - the chat templates of Qwen3, Phi-3.5, Llama 3.x, Mistral Nemo and Gemma rendered
#   by Python's jinja2 as transformers renders them (scripts/chat_oracle.py,
#   crates/engine/tests/chat_templates.rs).
#
# Needs the default model and Gemma 3 (`pdserve pull`, `pdserve pull gemma3-270m`)
# and the test venv's Python; builds the
# peer's llama-quantize and libllama on first use (scripts/build-peer.sh oracle).
# Idempotent: files already made are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PDSERVE_ORACLE_PYTHON:-target/test-venv/bin/python}
out=target/oracle
mkdir -p "$out"
bin=$(scripts/build-peer.sh oracle)
peer=$(dirname "$(dirname "$bin")")
"$py" -m pip install -q --disable-pip-version-check numpy tqdm pyyaml requests jinja2 typing-extensions
export PYTHONPATH="$peer/src/vendor/llama.cpp/gguf-py"
cache="${PDSERVE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve}/models"
smol="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
gemma="$cache/gemma-3-270m-q4_k_m.gguf"
for f in "$smol" "$gemma"; do
  [ -f "$f" ] || { echo "make_oracle: $f is missing; run \`pdserve pull\` and \`pdserve pull gemma3-270m\` first" >&2; exit 1; }
done
vendor="$peer/src/vendor/llama.cpp"
mkdir -p "$out/vocab"
for v in llama-bpe qwen2 phi-3 llama-spm; do
  cp "$vendor/models/ggml-vocab-$v.gguf"* "$out/vocab/"
done
"$py" scripts/chat_oracle.py "$vendor" "$out"
mkdir -p "$out/split"
for n in 3 2; do
  [ -f "$out/split/smollm2-$n-00001-of-0000$n.gguf" ] ||
    "$bin/llama-gguf-split" --split-max-tensors $((280 / n)) "$smol" "$out/split/smollm2-$n" >/dev/null 2>&1
done

# "Once upon a time, there was a little" and llama.cpp's greedy continuation on the
# default model (crates/engine/tests/golden/smollm2-135m-q4_1.json), then ids spread
# over the vocabulary.
tokens=$("$py" - <<'EOF'
import json
g = json.load(open("crates/engine/tests/golden/smollm2-135m-q4_1.json"))["greedy"][1]
ids = g["prompt_ids"] + g["ids"][:24]
ids += [(i * 7919 + 13) % 49000 + 100 for i in range(64 - len(ids))]
print(len(g["prompt_ids"]) + 24, " ".join(map(str, ids)))
EOF
)
text_tokens=${tokens%% *}
tokens=${tokens#* }

quantize() { # SRC DST TYPE [extra flags]
  [ -f "$2" ] || "$bin/llama-quantize" "${@:4}" "$1" "$2" "$3" >"$2.log" 2>&1 || { cat "$2.log" >&2; exit 1; }
}
logits() { # MODEL
  [ -f "${1%.gguf}.f32" ] || "$py" scripts/peer_logits.py "$peer" "$1" "${1%.gguf}.f32" $tokens
}

files=()
for arch in llama qwen2 qwen3 qwen3moe phi3; do
  src="$out/$arch-tiny-f16.gguf"
  # Phi-3's vocabulary (llama.cpp looks its special tokens up by name), padded to
  # SmolLM2's size so that the same token ids serve every file.
  donor=("--donor" "$smol")
  [ "$arch" = phi3 ] && donor=("--donor" "$out/vocab/ggml-vocab-phi-3.gguf" "--vocab" 49152)
  [ -f "$src" ] || "$py" scripts/random_gguf.py "$arch" tiny "$src" "${donor[@]}" --seed 7
  for q in Q4_K_M Q8_0; do
    quantize "$src" "$out/$arch-tiny-$q.gguf" "$q"
    files+=("$arch-tiny-$q.gguf")
  done
done
# The original Q4_1 file too: the control, whose agreement the golden tests check.
cp -n "$smol" "$out/smollm2-Q4_1.gguf"
files+=("smollm2-Q4_1.gguf")
for q in Q4_K_M Q5_K_M Q6_K Q3_K_M Q2_K Q5_0 Q5_1 IQ4_NL IQ4_XS; do
  quantize "$smol" "$out/smollm2-$q.gguf" "$q" --allow-requantize
  files+=("smollm2-$q.gguf")
done
for f in "${files[@]}"; do logits "$out/$f"; done
# The default model's pooled embeddings (mean, then last token) of the text tokens.
embed="$out/smollm2-Q4_1.embed.f32"
[ -f "$embed" ] || "$py" scripts/peer_embeddings.py "$peer" "$out/smollm2-Q4_1.gguf" "$embed" $(echo $tokens | cut -d' ' -f1-"$text_tokens")

"$py" - "$out" "${files[*]}" "$text_tokens" $tokens <<'EOF'
import json, sys
out, files, text, tokens = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), [int(t) for t in sys.argv[4:]]
manifest = {"reference": "llama.cpp (llama-cpp-python 0.3.36 sources), CPU, flash attention off",
            "tokens": tokens, "text_tokens": text,
            "embeddings": {"model": "smollm2-Q4_1.gguf", "file": "smollm2-Q4_1.embed.f32", "pooling": ["mean", "last"]},
            "files": [{"model": f, "logits": f[:-len(".gguf")] + ".f32", "real_weights": f.startswith("smollm2")}
                      for f in files]}
json.dump(manifest, open(f"{out}/oracle.json", "w"), indent=1)
EOF
echo "$out/oracle.json"
