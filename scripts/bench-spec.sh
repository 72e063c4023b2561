#!/usr/bin/env bash
# Speculative decoding (docs/speculative.md) against none on the same server build,
# aggregated and disaggregated, on input-grounded and open-ended chat workloads
# (scripts/bench_spec.py): TPOT p50/p99 at each concurrency, and the ratio.
#
#   scripts/bench-spec.sh                   the default model, n-gram drafts
#   SPECS="none draft" MODEL=M DRAFT=D scripts/bench-spec.sh
#                                           target M drafted for by model D
#   (also CONCURRENCY=1,4 REQUESTS=2 OUT=128 MODES="aggregated disaggregated",
#   SPEC_FLAGS="--spec-verify all" for every speculating server)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench-results/spec; mkdir -p "$out"; : > "$out/spec.jsonl"
cargo build --release --bin pdserve >&2
text=$(scripts/fetch-text.sh)
port=18095
model=${MODEL:-smollm2-135m}
for mode in ${MODES:-aggregated disaggregated}; do
  for spec in ${SPECS:-none ngram}; do
    args=(--speculative "$spec")
    [ "$spec" = draft ] && args+=(--draft-model "${DRAFT:?SPECS has draft: set DRAFT}")
    [ "$spec" != none ] && args+=(${SPEC_FLAGS:-})
    ./target/release/pdserve serve --model "$model" --mode "$mode" --port $port "${args[@]}" \
      > "$out/serve-$mode-$spec.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
    python3 scripts/bench_spec.py "http://127.0.0.1:$port" "$mode/$spec" "$text" "${CONCURRENCY:-1,4}" \
      "${REQUESTS:-2}" "${OUT:-128}" | tee -a "$out/spec.jsonl" >&2
    curl -s "http://127.0.0.1:$port/metrics" | grep '^pdserve_spec' >&2 || true
    kill $pid; wait $pid 2>/dev/null || true
  done
done
python3 - "$out/spec.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
key = lambda r: (r["label"].split("/")[0], r["workload"], r["concurrency"])
base = {key(r): r for r in rows if r["label"].endswith("/none")}
print("| mode | workload | C | spec | TPOT p50 ms none → spec | p50 gain | TPOT p99 ms none → spec | tok/s gain |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    b = base.get(key(r))
    spec = r["label"].split("/")[1]
    if spec != "none" and b:
        print(f'| {key(r)[0]} | {r["workload"]} | {r["concurrency"]} | {spec} | {b["tpot_p50_ms"]:.1f} → '
              f'{r["tpot_p50_ms"]:.1f} | {b["tpot_p50_ms"] / r["tpot_p50_ms"]:.2f}× | {b["tpot_p99_ms"]:.1f} → '
              f'{r["tpot_p99_ms"]:.1f} | {r["tok_s"] / b["tok_s"]:.2f}× |')
PY
