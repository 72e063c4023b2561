#!/usr/bin/env bash
# One hot prefix and a worker that joins late: `pdserve frontend --mode aggregated`
# over two one-thread `pdserve worker` processes on the default model, the second
# started JOIN_AFTER seconds into the load, when the first already caches the prefix.
# Per case (a policy, with or without prefix fetching) it reports TTFT and goodput
# over the whole run, and after the join: the newcomer's share of the requests, when
# it served its first, and TTFT p50/p99 (from the frontend's request log).
# See docs/bench/kv-routing.md ("A worker that joins after the prefix is cached").
#   CASES="kv-aware kv-aware/no-fetch least-loaded/no-fetch"  SECONDS_TOTAL=90  JOIN_AFTER=30
#   WORKLOAD="--shared-prefixes 1 --prefix-len 1024 --input-len 64 --output-len 64"  OUT=bench-results/late-join
set -euo pipefail
cd "$(dirname "$0")/.."
cases="${CASES:-kv-aware kv-aware/no-fetch least-loaded/no-fetch}"
secs="${SECONDS_TOTAL:-90}"
join="${JOIN_AFTER:-30}"
workload="${WORKLOAD:---shared-prefixes 1 --prefix-len 1024 --input-len 64 --output-len 64}"
out="${OUT:-bench-results/late-join}"; mkdir -p "$out"
cargo build --release --bin pdserve >&2
bin=./target/release/pdserve
port=18096
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

for c in $cases; do
  policy=${c%/no-fetch}
  fetch=(); [ "$policy" != "$c" ] && fetch=(--no-kv-fetch)
  name=${c//\//-}
  echo "== $c" >&2
  "$bin" worker --role mixed --listen 127.0.0.1:19101 --name w0 --insecure >"$out/$name.w0.log" 2>&1 &
  pids=($!)
  "$bin" frontend --mode aggregated --policy "$policy" "${fetch[@]}" --port "$port" --insecure \
    --workers 127.0.0.1:19101,127.0.0.1:19102 >"$out/$name.frontend.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
  # The newcomer, JOIN_AFTER seconds into the load (the frontend keeps dialling it).
  (sleep "$join"; date +%s.%N >"$out/$name.joined"
   exec "$bin" worker --role mixed --listen 127.0.0.1:19102 --name w1 --insecure >"$out/$name.w1.log" 2>&1) &
  pids+=($!)
  date +%s.%N >"$out/$name.started"
  # shellcheck disable=SC2086  # the workload is a list of flags
  "$bin" bench load --url "http://127.0.0.1:$port" --concurrency 4 $workload \
    --seconds "$secs" --requests 1000000 --slo-ttft-ms 1000 --slo-tpot-ms 200 --out "$out/$name.json" >&2
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^pdserve_kv_fetch(es_total|ed_tokens_total)' >"$out/$name.metrics" || true
  cleanup
  pids=()
done

python3 - "$out" $cases <<'PY'
import datetime, json, re, sys
out, cases = sys.argv[1], sys.argv[2:]

def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

print("| case | requests | TTFT p50 ms | TTFT p99 ms | goodput req/s | after the join: newcomer's share | its first request (s after join) | TTFT p50 / p99 ms | tokens fetched |")
print("|---|---|---|---|---|---|---|---|---|")
for c in cases:
    name = c.replace("/", "-")
    s = json.load(open(f"{out}/{name}.json"))["points"][0]["summary"]
    joined = float(open(f"{out}/{name}.joined").read())
    after, newcomer, first = [], 0, None
    for line in open(f"{out}/{name}.frontend.log"):
        m = re.match(r'(\S+Z) .*decode="(\w+)".*request finished.* ttft_ms=([\d.]+) duration_ms=([\d.]+)', line)
        if not m:
            continue
        end = datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        start = end - float(m.group(4)) / 1e3
        if start < joined:
            continue
        after.append(float(m.group(3)))
        if m.group(2) == "w1":
            newcomer += 1
            first = start - joined if first is None else min(first, start - joined)
    m = dict(l.rsplit(" ", 1) for l in open(f"{out}/{name}.metrics").read().splitlines() if l)
    fetched = float(m.get("pdserve_kv_fetched_tokens_total", 0))
    t = s["ttft_ms"]
    share = f"{newcomer}/{len(after)} ({100 * newcomer / len(after):.0f} %)" if after else "-"
    print(f'| {c} | {s["requests"]} | {t["p50"]:.0f} | {t["p99"]:.0f} | {s["goodput"]:.3f} | {share} | '
          f'{"-" if first is None else f"{first:.1f}"} | {pct(after, 0.5):.0f} / {pct(after, 0.99):.0f} | {fetched:.0f} |')
PY
