#!/bin/bash
cd /work/main
PORT=8451
for i in 1 2; do
for b in before after; do
  bin=/tmp/pdserve-before; [ $b = after ] && bin=target/release/pdserve
  $bin serve --mode aggregated --workers 1 --port $PORT > /tmp/dd-serve.log 2>&1 &
  pid=$!
  for _ in $(seq 100); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 0.2; done
  $bin bench load --url http://127.0.0.1:$PORT --shared-prefixes 1 --prefix-len 384 --input-len 64 --output-len 16 --concurrency 8,8,8,8 --requests 16 --out /tmp/dd-$b-$i.json > /tmp/dd-$b-$i.md 2>/dev/null
  kill $pid; wait $pid 2>/dev/null
  echo "== $b $i"; grep "^| C=" /tmp/dd-$b-$i.md
done
done
