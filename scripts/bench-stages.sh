#!/usr/bin/env bash
# One model in one worker process against the same model split by layers into a 2-
# and a 3-stage group (docs/decisions/2026-12-04-stage-groups-head-driven.md), each behind `pdserve frontend`, on this
# host over loopback: decode tok/s at batch 1 and aggregate at 8 sequences, and the
# ratio to one process. Every process has one compute thread and the stages take
# turns, so this measures what a split costs, not a speed-up.
#
#   scripts/bench-stages.sh                      the default model
#   MODEL=PATH SPLITS="0..14,15..29 0..9,10..19,20..29" scripts/bench-stages.sh
#   LINK=1gbit scripts/bench-stages.sh          loopback rate-limited by a token bucket (tc tbf,
#                                                root; every process's traffic, the one-process
#                                                run's too)
#   (also CONCURRENCY=1,8 REQUESTS=16 INPUT=64 OUTPUT=128)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench-results/stages; mkdir -p "$out"; : > "$out/stages.jsonl"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
model=${MODEL:-default}
token="$out/token"; head -c 32 /dev/urandom | base64 > "$token"; chmod 600 "$token"
common=(--model "$model" --role mixed --threads 1 --kv-blocks 1024 --cluster-token-file "$token")
pids=()
stop() { kill "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; pids=(); }
unshape() { [ -n "${LINK:-}" ] && tc qdisc del dev lo root 2>/dev/null || true; }
trap 'stop; unshape' EXIT
if [ -n "${LINK:-}" ]; then
  tc qdisc replace dev lo root tbf rate "$LINK" burst 256kb latency 50ms
fi
waitport() { for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.2; done; }

for split in "whole" ${SPLITS:-"0..14,15..29" "0..9,10..19,20..29"}; do
  head_args=()
  if [ "$split" != whole ]; then
    IFS=, read -r -a ranges <<< "$split"
    port=18200
    for r in "${ranges[@]:1}"; do
      port=$((port + 1))
      $bin worker "${common[@]}" --group g --layers "$r" --listen "127.0.0.1:$port" > "$out/stage-$r.log" 2>&1 &
      pids+=($!); waitport $port
      head_args+=(--stage "127.0.0.1:$port")
    done
    head_args+=(--group g --layers "${ranges[0]}")
  fi
  $bin worker "${common[@]}" "${head_args[@]}" --listen 127.0.0.1:18210 > "$out/head-$split.log" 2>&1 &
  pids+=($!); waitport 18210
  $bin frontend --model "$model" --workers 127.0.0.1:18210 --mode aggregated --port 18211 \
    --cluster-token-file "$token" > "$out/frontend-$split.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18211/health >/dev/null && break; sleep 0.2; done
  $bin bench load --url http://127.0.0.1:18211 --concurrency "${CONCURRENCY:-1,8}" \
    --input-len "${INPUT:-64}" --output-len "${OUTPUT:-128}" --requests "${REQUESTS:-16}" \
    --out "$out/load-$split.json" >&2
  python3 - "$out/load-$split.json" "$split" >> "$out/stages.jsonl" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for p in d["points"]:
    s, c = p["summary"], p["plan"]["issue"]["closed"]["concurrency"]
    tpot = s["tpot_ms"]["p50"]
    print(json.dumps({"split": sys.argv[2], "concurrency": c, "decode_tok_s": c * 1000 / tpot,
                      "tok_s": s["output_token_throughput"], "tpot_p50_ms": tpot}))
PY
  stop
done
python3 - "$out/stages.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = {r["concurrency"]: r for r in rows if r["split"] == "whole"}
print("| stages | C | TPOT p50 ms | decode tok/s (C / TPOT) | against one process | output tok/s (prefill included) | against one process |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    b = base[r["concurrency"]]
    n = 1 if r["split"] == "whole" else len(r["split"].split(","))
    print(f'| {n} ({r["split"]}) | {r["concurrency"]} | {r["tpot_p50_ms"]:.2f} | {r["decode_tok_s"]:.1f} | '
          f'{r["decode_tok_s"] / b["decode_tok_s"]:.3f}× | {r["tok_s"]:.1f} | {r["tok_s"] / b["tok_s"]:.3f}× |')
PY
