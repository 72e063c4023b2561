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
#   MICRO=off scripts/bench-stages.sh            heads send every step whole (--no-micro-batches):
#                                                against the default, micro-batches and decode
#                                                lanes where the stages' measured costs say they pay
#   ROLE=prefill TWIN=0 INPUT=1024 OUTPUT=4 CONCURRENCY=1 scripts/bench-stages.sh
#                                                disaggregated: the split (or whole) worker
#                                                prefills and hands each prompt's K/V over TCP
#                                                to a whole decode worker; read TTFT p50
#   ROLE=decode TWIN=0 INPUT=1024 OUTPUT=4 CONCURRENCY=1 scripts/bench-stages.sh
#                                                the other way: a whole prefill worker hands to
#                                                the split (or whole) decode worker; the K/V's
#                                                last frames are awaited before the second
#                                                token, so read TPOT p50 (and TTFT p50)
#   BIN=path                                     run that pdserve build (no cargo build): a
#                                                before/after of the same points
#   (also CONCURRENCY=1,8 REQUESTS=16 INPUT=64 OUTPUT=128)
#   TWIN=0                                       skip the twin: by default each split is also
#                                                simulated (`pdserve sim --group-stages`) on a
#                                                profile of this machine (PROFILE=path, or one made
#                                                here first) over loopback, 1 GbE and 10 GbE
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench-results/stages; mkdir -p "$out"; : > "$out/stages.jsonl"; rm -f "$out"/sim-*.json
[ -n "${BIN:-}" ] || cargo build --release --bin pdserve >&2
bin=${BIN:-./target/release/pdserve}
role=${ROLE:-mixed}
model=${MODEL:-default}
token="$out/token"; head -c 32 /dev/urandom | base64 > "$token"; chmod 600 "$token"
common=(--model "$model" --threads 1 --kv-blocks 1024 --cluster-token-file "$token")
pids=()
stop() { kill "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; pids=(); }
unshape() { [ -n "${LINK:-}" ] && tc qdisc del dev lo root 2>/dev/null || true; }
trap 'stop; unshape' EXIT
load=(--concurrency "${CONCURRENCY:-1,8}" --input-len "${INPUT:-64}" --output-len "${OUTPUT:-128}"
  --requests "${REQUESTS:-16}")
profile=${PROFILE:-$out/profile-$(basename "$model" .gguf).json}
if [ "${TWIN:-1}" != 0 ] && [ ! -f "$profile" ]; then
  # Timed before any shaping: its TCP link is loopback's.
  $bin profile --model "$model" --threads 1 --kv-blocks 1024 --out "$profile" >&2
fi
# The twin's prediction for a group of $1 stages over link $2.
twin() {
  [ "${TWIN:-1}" != 0 ] || return 0
  $bin sim --profile "$profile" --mode aggregated --workers 1 --threads-per-worker 1 --kv-blocks 1024 \
    --group-stages "$1" --stage-link "$2" "${load[@]}" --out "$out/sim-$1-$2.json" > /dev/null
}
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
      $bin worker "${common[@]}" --role mixed --group g --layers "$r" --listen "127.0.0.1:$port" > "$out/stage-$r.log" 2>&1 &
      pids+=($!); waitport $port
      head_args+=(--stage "127.0.0.1:$port")
    done
    head_args+=(--group g --layers "${ranges[0]}")
    if [ "${MICRO:-auto}" = off ]; then head_args+=(--no-micro-batches); fi
  fi
  $bin worker "${common[@]}" "${head_args[@]}" --role "$role" --listen 127.0.0.1:18210 > "$out/head-$split.log" 2>&1 &
  pids+=($!); waitport 18210
  workers=127.0.0.1:18210 mode=(--mode aggregated)
  if [ "$role" = prefill ] || [ "$role" = decode ]; then
    # The other side of the handoff: one whole worker.
    other=decode; [ "$role" = decode ] && other=prefill
    $bin worker "${common[@]}" --role $other --listen 127.0.0.1:18212 > "$out/$other-$split.log" 2>&1 &
    pids+=($!); waitport 18212
    workers+=,127.0.0.1:18212 mode=(--mode disaggregated --kv-transport tcp)
  fi
  $bin frontend --model "$model" --workers "$workers" "${mode[@]}" --port 18211 \
    --cluster-token-file "$token" > "$out/frontend-$split.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do curl -sf http://127.0.0.1:18211/health >/dev/null && break; sleep 0.2; done
  $bin bench load --url http://127.0.0.1:18211 "${load[@]}" --out "$out/load-$split.json" >&2
  python3 - "$out/load-$split.json" "$split" >> "$out/stages.jsonl" <<'PY'
import json, re, sys, urllib.request
d = json.load(open(sys.argv[1]))
# The head's stage totals over the whole run (every point): per step and per token.
text = urllib.request.urlopen("http://127.0.0.1:18211/metrics").read().decode()
def total(name, filt=""):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name) and filt in l)
steps, rows = total("pdserve_stage_steps_total"), total("pdserve_stage_rows_total")
stage = None
if steps:
    compute = {m.group(1): float(m.group(2)) for m in
               re.finditer(r'pdserve_stage_compute_seconds_total\{[^}]*layers="([^"]+)"\} (\S+)', text)}
    # The links' share is measured on the steps sent whole only (not in micro-batches, not lanes).
    pipelined = total("pdserve_stage_pipelined_steps_total")
    lanes = total("pdserve_stage_lane_steps_total")
    stage = {"steps": steps, "rows": rows, "pipelined": pipelined, "lanes": lanes,
             "bytes_per_token": total("pdserve_stage_activation_bytes_per_token"),
             "link_ms_per_whole_step": 1000 * total("pdserve_stage_link_seconds_total") / max(steps - pipelined - lanes, 1),
             "compute_ms_per_step": {k: 1000 * v / steps for k, v in compute.items()}}
for p in d["points"]:
    s, c = p["summary"], p["plan"]["issue"]["closed"]["concurrency"]
    tpot = s["tpot_ms"]["p50"]
    print(json.dumps({"split": sys.argv[2], "concurrency": c, "decode_tok_s": c * 1000 / tpot,
                      "ttft_p50_ms": s["ttft_ms"]["p50"],
                      "tok_s": s["output_token_throughput"], "tpot_p50_ms": tpot, "stage": stage}))
PY
  stop
  n=1; [ "$split" = whole ] || n=$(( $(tr -cd , <<< "$split" | wc -c) + 1 ))
  for l in loopback 1gbe 10gbe; do twin "$n" "$l"; done
done
python3 - "$out/stages.jsonl" "$out" <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def twin(n, link):
    """The twin's TPOT p50 by concurrency for n stages over link, if it ran."""
    path = os.path.join(sys.argv[2], f"sim-{n}-{link}.json")
    if not os.path.exists(path):
        return {}
    d = json.load(open(path))
    return {p["plan"]["issue"]["closed"]["concurrency"]: p["summary"]["tpot_ms"]["p50"] for p in d["points"]}
base = {r["concurrency"]: r for r in rows if r["split"] == "whole"}
print("| stages | C | TTFT p50 ms | TPOT p50 ms | decode tok/s (C / TPOT) | against one process | output tok/s (prefill included) | against one process |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    b = base[r["concurrency"]]
    n = 1 if r["split"] == "whole" else len(r["split"].split(","))
    print(f'| {n} ({r["split"]}) | {r["concurrency"]} | {r["ttft_p50_ms"]:.1f} | {r["tpot_p50_ms"]:.2f} | {r["decode_tok_s"]:.1f} | '
          f'{r["decode_tok_s"] / b["decode_tok_s"]:.3f}× | {r["tok_s"]:.1f} | {r["tok_s"] / b["tok_s"]:.3f}× |')
if any(twin(1, "loopback").values()):
    print()
    print("| stages | C | measured TPOT p50 ms | twin's, loopback | error | twin's decode tok/s against one host: loopback | 1 GbE | 10 GbE |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        n, c = 1 if r["split"] == "whole" else len(r["split"].split(",")), r["concurrency"]
        t = {l: twin(n, l).get(c) for l in ("loopback", "1gbe", "10gbe")}
        one = twin(1, "loopback").get(c)
        if t["loopback"] is None or one is None:
            continue
        ratio = " | ".join(f"{one / t[l]:.3f}×" if t[l] else "–" for l in ("loopback", "1gbe", "10gbe"))
        err = (t["loopback"] - r["tpot_p50_ms"]) / r["tpot_p50_ms"]
        print(f'| {n} | {c} | {r["tpot_p50_ms"]:.2f} | {t["loopback"]:.2f} | {100 * err:+.1f} % | {ratio} |')
print()
print("| stages | steps | in micro-batches | in lanes | bytes per token | link ms per whole step | compute ms per step, by stage |")
print("|---|---|---|---|---|---|---|")
seen = set()
for r in rows:
    st = r.get("stage")
    if not st or r["split"] in seen:
        continue
    seen.add(r["split"])
    by_layer = sorted(st["compute_ms_per_step"].items(), key=lambda kv: int(kv[0].split("..")[0]))
    per = ", ".join(f"{k}: {v:.2f}" for k, v in by_layer)
    print(f'| {r["split"]} | {st["steps"]:.0f} | {st.get("pipelined", 0):.0f} | {st.get("lanes", 0):.0f} | {st["bytes_per_token"]:.0f} | '
          f'{st["link_ms_per_whole_step"]:.3f} | {per} |')
PY
