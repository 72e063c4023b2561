#!/usr/bin/env bash
# The planner under constant load for 30 minutes, on the twin (a virtual clock, so
# seconds of real time): the no-oscillation check. Each case is WORKERS:RATE:LENGTHS
# (bench load's --phase lengths, ISL/OSL[+ISL/OSL]); a table of switches per case.
#   usage: scripts/planner-constant.sh PROFILE [OUT]   (SECONDS_PER_CASE=1800)
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:?usage: $0 PROFILE [OUT]}"
out="${2:-bench-results/planner-constant}"; mkdir -p "$out"
secs="${SECONDS_PER_CASE:-1800}"
cases=(${CASES:-2:0.5:512/128 2:0.6:512/128 2:0.7:512/128 2:0.4:128/512 2:0.3:2048/32 2:0.4:2048/32+128/512 16:4.0:512/128 16:3.2:128/512 16:3.2:2048/32+128/512})
cargo build --release --bin pdserve >&2
echo "| workers | rate req/s | lengths | goodput req/s (SLO %) | ok | failed | switches | moves |"
echo "|---|---|---|---|---|---|---|---|"
for c in "${cases[@]}"; do
  IFS=: read -r w r l <<< "$c"
  name="${w}w-${r}-${l//\//_}"; name="${name//+/-}"
  RUST_LOG=info ./target/release/pdserve sim --profile "$profile" --mode auto --workers "$w" --planner \
    --threads-per-worker 1 --phase "constant:$secs:$r:$l" --seed 7 --slo-ttft-ms 5000 --slo-tpot-ms 10 \
    --out "$out/$name.json" >"$out/$name.md" 2>"$out/$name.log"
  row=$(tail -1 "$out/$name.md")
  goodput=$(echo "$row" | cut -d'|' -f11 | xargs); ok=$(echo "$row" | cut -d'|' -f14 | xargs)
  failed=$(echo "$row" | cut -d'|' -f15 | xargs)
  n=$(grep -c "switching roles" "$out/$name.log" || true)
  moves=$(grep -o "switching roles from=[^ ]* to=[^ ]*" "$out/$name.log" | sed "s/switching roles from=//; s/ to=/ → /" | paste -sd, - || true)
  echo "| $w | $r | $l | $goodput | $ok | $failed | $n | ${moves:--} |"
done
