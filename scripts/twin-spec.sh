#!/usr/bin/env bash
# The twin's prediction of speculative decoding against a server's (docs/speculative.md,
# "In the twin"), on the draft-model pair of scripts/make-draft-pair.sh:
#
#   1. `pdserve profile --threads 2` of the F16 target and of the Q4_1 draft (kept in
#      bench-results/twin-spec/ and reused; delete them to time them again);
#   2. per workload, scripts/bench-spec.sh with SPECS="none ngram draft", aggregated:
#      the measured TPOT p50 of each, and each server's counters after its run (the
#      draft server's accepted and drafting shares, the n-gram server's for a lookup);
#   3. `pdserve sim` of the target's profile with the workload's mean prompt (as the
#      server counted it), plain and with the draft server's figures, with and without
#      the n-gram server's figures for the requests that draft by lookup.
#
#   scripts/twin-spec.sh     (also WORKLOADS="code extract" CONCURRENCY=1,4 REQUESTS=8 OUT=128;
#                            SIM_ONLY=1 simulates again from the measurements kept)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench-results/twin-spec; mkdir -p "$out"
target=$(scripts/make-draft-pair.sh)
cargo build --release --bin pdserve >&2
conc=${CONCURRENCY:-1,4}
requests=${REQUESTS:-8}
len=${OUT:-128}
for m in target draft; do
  [ -s "$out/$m.json" ] && continue
  model=$target; [ $m = draft ] && model=smollm2-135m
  ./target/release/pdserve profile --model "$model" --threads 2 --out "$out/$m.json" 2> "$out/profile-$m.log"
done
for w in ${WORKLOADS:-code extract}; do
  if [ -z "${SIM_ONLY:-}" ]; then
    SPECS="none ngram draft" MODES=aggregated MODEL="$target" DRAFT=smollm2-135m WORKLOADS=$w \
      CONCURRENCY=$conc REQUESTS=$requests OUT=$len scripts/bench-spec.sh > "$out/measured-$w.md"
    rm -rf "${out:?}/$w"; mkdir -p "$out/$w"; cp bench-results/spec/load-*.json bench-results/spec/metrics-*.txt "$out/$w/"
  fi
  read -r input acc drafting lacc ldrafting < <(python3 - "$out/$w" "$w" <<'PY'
import glob, json, sys
d, w = sys.argv[1], sys.argv[2]
def counter(spec, name):
    text = open(f"{d}/metrics-aggregated-{spec}-1.txt").read()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{"))
recs = [r for p in json.load(open(f"{d}/load-aggregated-none-{w}-1.json"))["points"] for r in p["records"] if r["ok"]]
share = lambda s: counter(s, "pdserve_spec_accepted_tokens_total") / counter(s, "pdserve_spec_draft_tokens_total")
print(round(sum(r["input_tokens"] for r in recs) / len(recs)), f"{share('draft'):.3f}",
      f"{counter('draft', 'pdserve_spec_drafting_share'):.3f}", f"{share('ngram'):.3f}",
      f"{counter('ngram', 'pdserve_spec_drafting_share'):.3f}")
PY
)
  echo "$w: $input tokens in; draft accepted $acc, drafting $drafting; lookup accepted $lacc, drafting $ldrafting" >&2
  sim=(./target/release/pdserve sim --profile "$out/target.json" --mode aggregated --input-len "$input"
    --output-len "$len" --concurrency "$conc" --requests "$requests")
  spec=(--spec-tokens 8 --spec-acceptance "$acc" --spec-drafting "$drafting" --spec-draft-profile "$out/draft.json")
  "${sim[@]}" --out "$out/$w/sim-none.json" > /dev/null 2>&1
  "${sim[@]}" "${spec[@]}" --out "$out/$w/sim-draft.json" > /dev/null 2>&1
  "${sim[@]}" "${spec[@]}" --spec-lookup-acceptance "$lacc" --spec-lookup-drafting "$ldrafting" \
    --out "$out/$w/sim-draft-lookup.json" > /dev/null 2>&1
done
python3 - "$out" ${WORKLOADS:-code extract} <<'PY'
import json, sys
out, workloads = sys.argv[1], sys.argv[2:]
p50 = lambda path: {int(p["plan"]["label"][2:]): p["summary"]["tpot_ms"]["p50"] for p in json.load(open(path))["points"]}
print("| workload | C | measured TPOT p50 plain → draft | twin, lookup's figures | twin, a lookup drafts nothing |")
print("|---|---|---|---|---|")
for w in workloads:
    d = f"{out}/{w}"
    m0, m1 = p50(f"{d}/load-aggregated-none-{w}-1.json"), p50(f"{d}/load-aggregated-draft-{w}-1.json")
    s0, s1, s2 = p50(f"{d}/sim-none.json"), p50(f"{d}/sim-draft-lookup.json"), p50(f"{d}/sim-draft.json")
    for c in sorted(m0):
        cell = lambda a, b: f"{a:.1f} → {b:.1f} ms ({a / b:.2f}×)"
        print(f"| {w} | {c} | {cell(m0[c], m1[c])} | {cell(s0[c], s1[c])} | {cell(s0[c], s2[c])} |")
PY
