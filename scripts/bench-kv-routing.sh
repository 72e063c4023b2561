#!/usr/bin/env bash
# KV-aware routing: multi-turn chat replayed against `pdserve serve --mode aggregated
# --workers 2` (1 thread each) once per routing policy, each on a fresh server, same
# workload. Reports TTFT, goodput, the router's predicted vs realized cache hits, and
# the load imbalance: each worker's requests waiting or running and prompt tokens
# queued, as the server's /metrics says every half second, averaged over the run
# (max over mean of the workers).
# See docs/bench/kv-routing.md.
#   POLICIES="kv-aware least-loaded round-robin"  SECONDS_PER_POINT=180
#   WORKLOAD="--conversations 17 --turns 5..10 --input-len 100..200 --output-len 32..64"
#   CONCURRENCY=4  SERVE_ARGS="--kv-host-gb 1"  OUT=bench-results/kv-routing
#   LOAD="--rate 2" (open loop instead of the closed loop), or LOAD="--trace-speedup 1"
#   with WORKLOAD="--trace FILE"
#   TOPOLOGY="--mode disaggregated --prefill 1 --decode 1" (instead of aggregated ×2)
set -euo pipefail
cd "$(dirname "$0")/.."
policies="${POLICIES:-kv-aware least-loaded round-robin}"
secs="${SECONDS_PER_POINT:-180}"
workload="${WORKLOAD:---conversations 17 --turns 5..10 --input-len 100..200 --output-len 32..64}"
c="${CONCURRENCY:-4}"
load="${LOAD:---concurrency $c}"
serve_args="${SERVE_ARGS:-}"
topology="${TOPOLOGY:---mode aggregated --workers 2}"
out="${OUT:-bench-results/kv-routing}"; mkdir -p "$out"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
port=18095
source scripts/fresh-server.sh

for p in $policies; do
  echo "== $p" >&2
  # shellcheck disable=SC2086  # the topology and extra serve flags are lists
  start_server "$out/$p.server.log" $topology --policy "$p" $serve_args
  # Each worker's queue, sampled while the load runs.
  while sleep 0.5; do
    curl -s "http://127.0.0.1:$port/metrics" | grep -E '^pdserve_worker_(requests|queued_prompt_tokens)\{' | sed 's/^/@ /'
  done >"$out/$p.queues" &
  sampler=$!
  # shellcheck disable=SC2086  # the workload is a list of flags
  "$bin" bench load --url "http://127.0.0.1:$port" $load $workload \
    --seconds "$secs" --requests 1000000 --slo-ttft-ms 1000 --slo-tpot-ms 200 --out "$out/$p.json" >&2
  kill "$sampler" 2>/dev/null || true
  curl -s "http://127.0.0.1:$port/metrics" \
    | grep -E '^pdserve_(prefix_hit_mismatch_total|kv_index_lag_seconds_(sum|count)|kv_fetched_tokens_total|kv_fetches_total)' \
    >"$out/$p.metrics" || true
  stop_server
done

python3 - "$out" $policies <<'PY'
import json, re, sys
from collections import defaultdict
out, policies = sys.argv[1], sys.argv[2:]

def imbalance(path):
    """Max over mean of each worker's time-averaged requests (waiting + running) and
    queued prompt tokens; '-' without samples."""
    reqs, toks, n = defaultdict(float), defaultdict(float), defaultdict(int)
    for line in open(path):
        m = re.match(r'@ pdserve_worker_(requests|queued_prompt_tokens)\{worker="([^"]+)"(?:,state="\w+")?\} (\S+)', line)
        if not m:
            continue
        kind, w, v = m.group(1), m.group(2), float(m.group(3))
        if kind == "requests":
            reqs[w] += v
            n[w] += 0.5  # two series (waiting, running) per sample
        else:
            toks[w] += v
    if not n:
        return "-", "-"
    def ratio(total):
        means = [total[w] / n[w] for w in n]
        mean = sum(means) / len(means)
        return f"{max(means) / mean:.2f} ({' / '.join(f'{x:.2f}' for x in means)})" if mean else "-"
    return ratio(reqs), ratio(toks)

print("| policy | requests | TTFT p50 ms | TTFT p99 ms | goodput req/s | out tok/s | cached tokens predicted | realized | realized/predicted | of them fetched from a peer | index lag mean ms | imbalance: requests in flight (per worker) | prompt tokens queued (per worker) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for p in policies:
    s = json.load(open(f"{out}/{p}.json"))["points"][0]["summary"]
    h = s.get("prefix_hits") or {"predicted": 0, "realized": 0}
    m = dict(l.rsplit(" ", 1) for l in open(f"{out}/{p}.metrics").read().splitlines() if l)
    fetched = float(m.get("pdserve_kv_fetched_tokens_total", 0))
    lag_n = float(m.get("pdserve_kv_index_lag_seconds_count", 0))
    lag = 1e3 * float(m.get("pdserve_kv_index_lag_seconds_sum", 0)) / lag_n if lag_n else float("nan")
    pct = f'{100 * h["realized"] / h["predicted"]:.1f} %' if h["predicted"] else "-"
    t = s["ttft_ms"]
    print(f'| {p} | {s["requests"]} | {t["p50"]:.0f} | {t["p99"]:.0f} | {s["goodput"]:.3f} | '
          f'{s["output_token_throughput"]:.1f} | {h["predicted"]:.0f} | {h["realized"]:.0f} | {pct} | {fetched:.0f} | {lag:.1f} | '
          f'{" | ".join(imbalance(f"{out}/{p}.queues"))} |')
PY
