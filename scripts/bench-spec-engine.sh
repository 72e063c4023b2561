#!/usr/bin/env bash
# Decode tok/s of one engine with speculation against without, in the same run
# (`pdserve bench engine --speculative`), at batch 1, 4 and 16, on three kinds of
# decode prompt: passages of a text quoted back (input-grounded), passages to go on
# with (open-ended text), and random token ids.
#
#   scripts/bench-spec-engine.sh                        the default model, n-gram drafts
#   MODEL=M SPEC="--speculative draft --draft-model D" scripts/bench-spec-engine.sh
#   (also BATCH=1,4,16 TOKENS=128 PROMPT=512 REPS=2 THREADS=2)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bin pdserve >&2
text=$(scripts/fetch-text.sh)
for prompts in "--decode-text $text --decode-quote" "--decode-text $text" ""; do
  echo "## ${MODEL:-default} ${SPEC:---speculative ngram} ${prompts:-random ids}" | sed "s|$text|text|"
  # shellcheck disable=SC2086
  ./target/release/pdserve bench engine --model "${MODEL:-default}" --threads "${THREADS:-2}" --prefill 128 \
    --batch "${BATCH:-1,4,16}" --decode-prompt "${PROMPT:-512}" --decode-tokens "${TOKENS:-128}" \
    --reps "${REPS:-2}" ${SPEC:---speculative ngram} $prompts 2>/dev/null | grep -E '^(decode|  spec)'
done
