#!/usr/bin/env bash
# Speculative decoding (docs/speculative.md) against none on the same server build,
# aggregated and disaggregated, on input-grounded and open-ended chat workloads
# (prompts from scripts/bench_spec.py), measured by `pdserve bench load`: TPOT p50/p99
# and output tok/s at each concurrency, drafted and accepted tokens, and the ratios.
#
#   scripts/bench-spec.sh                   the default model, n-gram drafts
#   SPECS="none draft" MODEL=M DRAFT=D scripts/bench-spec.sh
#                                           target M drafted for by model D
#   (also CONCURRENCY=1,4,16 REQUESTS=8 OUT=128 MODES="aggregated disaggregated"
#   WORKLOADS="code quote extract open", SPEC_FLAGS="--spec-verify all" for every
#   speculating server; a closed-loop point sends at least 2 × C requests; REPEAT=3
#   runs every server that many times, in turn, and reports the median gain with the
#   range of the rounds; BIN=path serves with that build instead of building one,
#   RESULTS=dir writes there instead of bench-results/spec)
# Servers take --max-queue-seconds 0, so that none sheds and both sides of a ratio
# serve every request.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${RESULTS:-bench-results/spec}; mkdir -p "$out"; rm -f "$out"/load-*.json "$out"/metrics-*.txt
bin=${BIN:-./target/release/pdserve}
[ -n "${BIN:-}" ] || cargo build --release --bin pdserve >&2
text=$(scripts/fetch-text.sh)
conc=${CONCURRENCY:-1,4,16}
requests=${REQUESTS:-8}
# Enough prompts that no request of any point (or the warm-up) repeats another's: a
# closed-loop point sends max(REQUESTS, 2 × C) requests at most.
points=$(echo "$conc" | tr ',' '\n' | wc -l)
most_c=$(echo "$conc" | tr ',' '\n' | sort -n | tail -1)
per_point=$(( requests > 2 * most_c ? requests : 2 * most_c ))
python3 scripts/bench_spec.py "$text" "$out" $(( points * per_point + 1 ))
port=18095
model=${MODEL:-smollm2-135m}
for round in $(seq "${REPEAT:-1}"); do
for mode in ${MODES:-aggregated disaggregated}; do
  for spec in ${SPECS:-none ngram}; do
    args=(--speculative "$spec")
    [ "$spec" = draft ] && args+=(--draft-model "${DRAFT:?SPECS has draft: set DRAFT}")
    [ "$spec" != none ] && args+=(${SPEC_FLAGS:-})
    "$bin" serve --model "$model" --mode "$mode" --port $port --max-queue-seconds 0 "${args[@]}" \
      > "$out/serve-$mode-$spec.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
    for w in ${WORKLOADS:-code quote extract open}; do
      "$bin" bench load --url "http://127.0.0.1:$port" --endpoint chat \
        --prompts "$out/$w.jsonl" --concurrency "$conc" --requests "$requests" --output-len "${OUT:-128}" \
        --warmup 1 --seconds 600 --out "$out/load-$mode-$spec-$w-$round.json" >&2
    done
    # The server's counters, for the twin (`pdserve sim --spec-acceptance ... --spec-drafting ...`).
    curl -sf "http://127.0.0.1:$port/metrics" > "$out/metrics-$mode-$spec-$round.txt" || true
    kill $pid; wait $pid 2>/dev/null || true
  done
done
done
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
runs = {}  # (mode, workload, C, spec) -> [summary per round]
for path in sorted(glob.glob(f"{sys.argv[1]}/load-*.json")):
    mode, spec, w, _ = os.path.basename(path)[5:-5].split("-")
    for p in json.load(open(path))["points"]:
        runs.setdefault((mode, w, int(p["plan"]["label"][2:]), spec), []).append(p["summary"])
med = lambda xs: statistics.median(xs)
span = lambda xs: f"{min(xs):.2f}–{max(xs):.2f}" if len(xs) > 1 else "—"
print("| mode | workload | C | spec | rounds | TPOT p50 ms none → spec | p50 gain (range) | TPOT p99 ms none → spec | tok/s gain (range) | accepted of drafted |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (mode, w, c, spec), ss in sorted(runs.items()):
    bs = runs.get((mode, w, c, "none"))
    if spec == "none" or not bs:
        continue
    pairs = list(zip(bs, ss))
    p50 = [b["tpot_ms"]["p50"] / s["tpot_ms"]["p50"] for b, s in pairs]
    tok = [s["output_token_throughput"] / b["output_token_throughput"] for b, s in pairs]
    t = lambda xs, q: med([x["tpot_ms"][q] for x in xs])
    d = [x.get("speculation") or {"accepted": 0, "drafted": 0} for x in ss]
    print(f'| {mode} | {w} | {c} | {spec} | {len(pairs)} | {t(bs, "p50"):.1f} → {t(ss, "p50"):.1f} | '
          f'{med(p50):.2f}× ({span(p50)}) | {t(bs, "p99"):.1f} → {t(ss, "p99"):.1f} | {med(tok):.2f}× ({span(tok)}) | '
          f'{sum(x["accepted"] for x in d):.0f} of {sum(x["drafted"] for x in d):.0f} |')
PY
