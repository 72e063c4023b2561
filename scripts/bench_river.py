"""The NimsForest River ingress against HTTP, on one `pdserve serve --nats URL --river`
(aggregated, default model) and a local nats-server, in the same run.

1. TTFT at C=1, streamed, 32 tokens: HTTP POST -> first content chunk, against River
   publish -> first Leaf on infer.stream.<request_id>.
2. Throughput at C=8: completion tokens/s of 8 clients in closed loop, 64 tokens each.
3. Leaf rate: 2000 one-token River requests published at once; Leaves the frontend
   publishes per second (accepted + result + completed for each) until the last.

Usage: python3 scripts/bench_river.py [--pdserve target/release/pdserve] [--nats-server PATH] [--out FILE]
Needs nats-py (the test venv has it: target/test-venv/bin/python).
"""
import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request

import nats


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def body(i, max_tokens):
    return {"prompt": f"Request {i}: the capital of France is", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdserve", default="target/release/pdserve")
    ap.add_argument("--nats-server", default=os.environ.get("PDSERVE_NATS_SERVER", "target/nats-venv/bin/nats-server"))
    ap.add_argument("--out")
    a = ap.parse_args()
    nport, hport = free_port(), free_port()
    url, api = f"nats://127.0.0.1:{nport}", f"http://127.0.0.1:{hport}"
    procs = [subprocess.Popen([a.nats_server, "-js", "-sd", tempfile.mkdtemp(), "-p", str(nport), "-a", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    time.sleep(0.5)
    procs.append(subprocess.Popen([a.pdserve, "serve", "--mode", "aggregated", "--nats", url, "--river",
                                   "--port", str(hport)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for _ in range(600):
        try:
            post(api + "/v1/completions", body(0, 1))
            break
        except Exception:
            time.sleep(0.1)
    nc = await nats.connect(url)
    js = nc.jetstream()
    waiting = {}
    leaves = [0]

    first = {}

    async def on_leaf(msg):
        leaves[0] += 1
        if msg.subject.startswith("infer.stream."):
            first.setdefault(msg.subject[len("infer.stream."):], time.perf_counter())
        if msg.subject.startswith("infer.result."):
            fut = waiting.pop(msg.subject[len("infer.result."):], None)
            if fut and not fut.done():
                fut.set_result(time.perf_counter())

    await nc.subscribe("infer.>", cb=on_leaf)
    await asyncio.sleep(2)  # the River consumer is up
    seq = [0]

    async def river(max_tokens):
        seq[0] += 1
        rid = f"b{seq[0]}"
        fut = asyncio.get_running_loop().create_future()
        waiting[rid] = fut
        t = time.perf_counter()
        await js.publish("river.infer.requests", json.dumps({**body(seq[0], max_tokens), "nimsforest": {"request_id": rid}}).encode())
        return await asyncio.wait_for(fut, 120) - t

    async def http(max_tokens):
        seq[0] += 1
        t = time.perf_counter()
        await asyncio.to_thread(post, api + "/v1/completions", body(seq[0], max_tokens))
        return time.perf_counter() - t

    def http_ttft_blocking(i):
        b = {**body(i, 32), "stream": True}
        req = urllib.request.Request(api + "/v1/completions", json.dumps(b).encode(), {"Content-Type": "application/json"})
        t = time.perf_counter()
        ttft = None
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if ttft is None and line.startswith(b"data: {") and b'"text":""' not in line:
                    ttft = time.perf_counter() - t
        return ttft

    async def http_ttft():
        seq[0] += 1
        return await asyncio.to_thread(http_ttft_blocking, seq[0])

    async def river_ttft():
        seq[0] += 1
        rid = f"b{seq[0]}"
        fut = asyncio.get_running_loop().create_future()
        waiting[rid] = fut
        t = time.perf_counter()
        b = {**body(seq[0], 32), "stream": True, "nimsforest": {"request_id": rid}}
        await js.publish("river.infer.requests", json.dumps(b).encode())
        await asyncio.wait_for(fut, 120)
        return first[rid] - t

    out = {}
    # 1. TTFT at C=1, streamed, interleaved so drift hits both alike.
    lat = {"http": [], "river": []}
    for _ in range(3):
        await http_ttft(), await river_ttft()
    for _ in range(60):
        lat["http"].append(await http_ttft())
        lat["river"].append(await river_ttft())
    for k, v in lat.items():
        out[f"{k}_c1_p50_ms"] = statistics.median(v) * 1e3
        out[f"{k}_c1_p90_ms"] = sorted(v)[int(0.9 * len(v))] * 1e3
    # 2. throughput at C=8, 64 tokens per request, 10 requests per client.
    for name, call in (("http", http), ("river", river)):
        t = time.perf_counter()

        async def client():
            for _ in range(10):
                await call(64)

        await asyncio.gather(*(client() for _ in range(8)))
        out[f"{name}_c8_tok_s"] = 8 * 10 * 64 / (time.perf_counter() - t)
    # 3. Leaf rate.
    n = 2000
    before = leaves[0]
    futs = []
    t = time.perf_counter()
    for i in range(n):
        seq[0] += 1
        rid = f"b{seq[0]}"
        fut = asyncio.get_running_loop().create_future()
        waiting[rid] = fut
        futs.append(fut)
        await js.publish("river.infer.requests", json.dumps({**body(seq[0], 1), "nimsforest": {"request_id": rid}}).encode())
    await asyncio.wait_for(asyncio.gather(*futs), 600)
    secs = time.perf_counter() - t
    await asyncio.sleep(0.5)
    out["leaf_rate_per_s"] = (leaves[0] - before) / secs
    out["river_requests_per_s"] = n / secs
    await nc.close()
    for p in reversed(procs):
        p.terminate()
        p.wait(timeout=30)
    print("| measure | HTTP | River | River / HTTP |")
    print("|---|---|---|---|")
    for m, unit in (("c1_p50_ms", "ms"), ("c1_p90_ms", "ms"), ("c8_tok_s", "tok/s")):
        h, r = out[f"http_{m}"], out[f"river_{m}"]
        print(f"| {m} | {h:.2f} {unit} | {r:.2f} {unit} | {r / h:.3f} |")
    print(f"Leaf rate: {out['leaf_rate_per_s']:.0f} Leaves/s ({out['river_requests_per_s']:.0f} one-token requests/s)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
