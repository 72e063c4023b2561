#!/usr/bin/env bash
# Overload: default `pdserve serve` under closed-loop load of 1500–2000-token prompts
# (128 output tokens) at its capacity and far past it, each point on a fresh server.
# Reports goodput, the share of requests shed (429), TTFT of accepted requests, client
# timeouts and the server's peak RSS. See docs/bench/overload.md.
#   POINTS="label:concurrency:max-queue-seconds ..."  SECONDS_PER_POINT=180  SERVE_ARGS=...
set -euo pipefail
cd "$(dirname "$0")/.."
points="${POINTS:-capacity:16:30 4x:64:30 16x:256:30 4x-no-admission:64:0}"
secs="${SECONDS_PER_POINT:-180}"
out=bench-results/overload; mkdir -p "$out"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
port=18090
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0; sleep 0.2; done; return 1; }

for p in $points; do
  IFS=: read -r label c queue <<<"$p"
  echo "== $label: C=$c, --max-queue-seconds $queue" >&2
  "$bin" serve --port $port --max-queue-seconds "$queue" ${SERVE_ARGS:-} >"$out/$label.server.log" 2>&1 &
  pid=$!; wait_up
  # Goodput SLO: the first token within the admission limit plus a prefill, and a
  # stream that keeps flowing.
  "$bin" bench load --url "http://127.0.0.1:$port" --concurrency "$c" --input-len 1500..2000 \
    --output-len 128 --seconds "$secs" --requests 1000000 --timeout-seconds 600 \
    --slo-ttft-ms 35000 --slo-tpot-ms 1000 --out "$out/$label.json" >&2
  awk '/VmHWM/ {print $2}' "/proc/$pid/status" >"$out/$label.rss_kb"
  kill $pid; wait $pid 2>/dev/null || true
done

python3 - "$out" $points <<'PY'
import json, sys
out, points = sys.argv[1], sys.argv[2:]
print("| point | C | max queue s | requests | shed (429) | client timeouts | goodput req/s | completed req/s | out tok/s | TTFT p50 s (accepted) | TTFT p99 s (accepted) | TTFT p99 s (accepted after 30 s) | peak RSS MiB |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for p in points:
    label, c, queue = p.split(":")
    point = json.load(open(f"{out}/{label}.json"))["points"][0]
    s = point["summary"]
    # Past the cold start, whose first pace measurements come from an empty server.
    warm = sorted(r["ttft_s"] for r in point["records"] if r["ok"] and r["start_s"] >= 30)
    warm_p99 = warm[min(len(warm) - 1, int(0.99 * len(warm)))] if warm else float("nan")
    rss = int(open(f"{out}/{label}.rss_kb").read()) / 1024
    share = 100 * s["shed"] / max(s["requests"], 1)
    t = s["ttft_ms"]
    print(f'| {label} | {c} | {queue} | {s["requests"]} | {s["shed"]} ({share:.0f} %) | {s["timed_out"]} | '
          f'{s["goodput"]:.3f} | {s["request_throughput"]:.3f} | {s["output_token_throughput"]:.1f} | '
          f'{t["p50"] / 1e3:.1f} | {t["p99"] / 1e3:.1f} | {warm_p99:.1f} | {rss:.0f} |')
PY
