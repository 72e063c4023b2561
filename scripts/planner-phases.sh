# The planner benchmarks' shifting workload, shared by scripts/bench-planner.sh (real
# workers) and scripts/bench-planner-sim.sh (the twin): sourced, it sets `phases` to
# the `--phase` flags of five phases, each SECS long (the sine twice that), every
# rate multiplied by SCALE. Also the SLOs both judge by: `ttft` and `tpot` in ms
# (TTFT_MS and TPOT_MS override them, for a machine slower than the one they suit).
#   usage: source scripts/planner-phases.sh SECS SCALE
ttft=${TTFT_MS:-5000} tpot=${TPOT_MS:-10}
_secs=$1 _scale=$2
_rate() { python3 -c "print(round($1 * $_scale, 4))"; }
phases=(
  --phase "decode-heavy:$_secs:$(_rate 0.4):128/512"
  --phase "prefill-heavy:$_secs:$(_rate 0.4):2048/32"
  --phase "balanced:$_secs:$(_rate 0.5):512/128"
  --phase "long-prompts:$_secs:$(_rate 0.33):1024/128"
  --phase "sin:$((2 * _secs)):$(_rate 0.4):2048/32+128/512:sin=$_secs"
)
