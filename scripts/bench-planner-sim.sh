#!/usr/bin/env bash
# The planner on a simulated fleet (`pdserve sim`, the twin): WORKERS one-thread
# workers on a profile of this machine, over the same shifting phases as
# scripts/bench-planner.sh with every rate multiplied by SCALE. Topologies: the planner
# (all mixed in `auto`, roles its own), today's auto with every worker mixed, every
# worker aggregated behind least-loaded, and every fixed split kP:(WORKERS-k)D in auto
# mode; the oracle is the best fixed topology of each phase. Minutes, not hours: the
# fleet runs on a virtual clock.
#   usage: scripts/bench-planner-sim.sh PROFILE [OUT]   (WORKERS=16 SCALE=8 PHASE_SECONDS=60)
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:?usage: $0 PROFILE [OUT]}"
out="${2:-bench-results/planner-sim}"; mkdir -p "$out"
n="${WORKERS:-16}" scale="${SCALE:-8}" secs="${PHASE_SECONDS:-60}"
source scripts/planner-phases.sh "$secs" "$scale"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
tops=("planner" "auto-${n}M" "aggregated-${n}")
for k in $(seq 1 $((n - 1))); do tops+=("fixed-${k}P$((n - k))D"); done
for t in "${tops[@]}"; do
  case $t in
    planner) args=(--mode auto --workers "$n" --planner) ;;
    auto-*M) args=(--mode auto --workers "$n") ;;
    aggregated-*) args=(--mode aggregated --workers "$n" --policy least-loaded) ;;
    fixed-*) p=${t#fixed-}; p=${p%%P*}; args=(--mode auto --prefill "$p" --decode $((n - p))) ;;
  esac
  echo "== $t: sim ${args[*]}" >&2
  RUST_LOG=info "$bin" sim --profile "$profile" "${args[@]}" --threads-per-worker 1 --max-queue-seconds 0 "${phases[@]}" \
    --seed 7 --slo-ttft-ms $ttft --slo-tpot-ms $tpot --out "$out/$t.json" \
    >"$out/$t.md" 2>"$out/$t.log"
  tail -1 "$out/$t.log" >&2
done
python3 scripts/planner_report.py "$out" "${tops[@]}" | tee "$out/report.md"
