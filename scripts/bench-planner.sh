#!/usr/bin/env bash
# The planner against fixed roles on this machine's two workers (one thread each),
# over one shifting workload: decode-heavy, then long prompts with a tight TPOT
# objective, then prefill-heavy, each phase an open-loop rate for PHASE_SECONDS.
# Every topology gets the same phases in the same order on a fresh server:
#   planner  = serve --mode auto --workers 2 --planner
#   auto-2M  = serve --mode auto --workers 2            (today's auto, mixed workers)
#   fixed-1P1D = serve --mode auto --prefill 1 --decode 1 (a dedicated split)
# Reports goodput and SLO attainment per phase and overall, the role switches and
# the failed requests; the oracle is the best fixed topology of each phase. See
# docs/benchmarks.md ("The planner").   PHASE_SECONDS=60  TOPOLOGIES="planner auto-2M fixed-1P1D"
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${PHASE_SECONDS:-60}"
topologies="${TOPOLOGIES:-planner auto-2M fixed-1P1D}"
ttft=5000 tpot=10
# label:rate:input-len:output-len
phases="decode-heavy:0.4:128:512 long-prompts:0.33:1024:128 prefill-heavy:0.4:2048:32"
out=bench-results/planner; mkdir -p "$out"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
port=18091
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0; sleep 0.2; done; return 1; }

for t in $topologies; do
  case $t in
    planner) args="--workers 2 --planner --slo-ttft-ms $ttft --slo-tpot-ms $tpot" ;;
    auto-2M) args="--workers 2" ;;
    fixed-1P1D) args="--prefill 1 --decode 1" ;;
    *) echo "unknown topology $t" >&2; exit 2 ;;
  esac
  echo "== $t: serve --mode auto $args" >&2
  RUST_LOG=info "$bin" serve --port $port --mode auto --max-queue-seconds 0 $args >"$out/$t.server.log" 2>&1 &
  pid=$!; wait_up
  for p in $phases; do
    IFS=: read -r label rate isl osl <<<"$p"
    "$bin" bench load --url "http://127.0.0.1:$port" --rate "$rate" --input-len "$isl" --output-len "$osl" \
      --seconds "$secs" --requests 1000000 --timeout-seconds 600 --seed 7 \
      --slo-ttft-ms $ttft --slo-tpot-ms $tpot --out "$out/$t.$label.json" >&2
  done
  curl -s "http://127.0.0.1:$port/metrics" >"$out/$t.metrics"
  kill $pid; wait $pid 2>/dev/null || true
done

python3 - "$out" "$topologies" "$phases" <<'PY'
import json, re, sys
out, tops, phases = sys.argv[1], sys.argv[2].split(), [p.split(":")[0] for p in sys.argv[3].split()]
res = {t: {p: json.load(open(f"{out}/{t}.{p}.json"))["points"][0]["summary"] for p in phases} for t in tops}
def switches(t):
    m = open(f"{out}/{t}.metrics").read()
    return int(sum(float(v) for v in re.findall(r'^pdserve_planner_decisions_total\{[^}]*\} (\S+)', m, re.M)))
fixed = [t for t in tops if t != "planner"]
oracle = {p: max(res[t][p]["goodput"] for t in fixed) for p in phases}
print("| topology | " + " | ".join(f"{p} goodput req/s (SLO %)" for p in phases) + " | whole trace goodput | failed | role switches |")
print("|---|" + "---|" * (len(phases) + 3))
for t in tops + ["oracle"]:
    if t == "oracle":
        cells = [f"{oracle[p]:.3f}" for p in phases]
        total = sum(oracle.values()) / len(phases)
        print(f"| oracle (best fixed per phase) | " + " | ".join(cells) + f" | {total:.3f} | — | — |")
        continue
    cells = [f'{res[t][p]["goodput"]:.3f} ({res[t][p]["slo_attainment_pct"]:.0f})' for p in phases]
    total = sum(res[t][p]["goodput"] for p in phases) / len(phases)
    failed = sum(res[t][p]["failed"] for p in phases)
    print(f"| {t} | " + " | ".join(cells) + f" | {total:.3f} | {failed} | {switches(t)} |")
if "planner" in tops:
    print()
    print("planner ÷ oracle per phase: " + ", ".join(f"{p} {res['planner'][p]['goodput'] / max(oracle[p], 1e-9):.2f}" for p in phases))
PY
