"""Structured outputs' cost over HTTP, pdserve next to llama-server on the same GGUF,
one compute thread each, one server at a time on this machine.

For each server and each batch size B: B chat requests at once, each 128 tokens,
unconstrained (`ignore_eos`) and then constrained by `response_format` json_schema (a
JSON list of 200 short strings, which no request finishes in 128 tokens, so every
token is constrained). Output tok/s = tokens / wall time of the batch, best of
--reps. Prints a Markdown table with each server's constrained/plain ratio.

Usage: python3 scripts/bench_structured.py [--pdserve target/release/pdserve]
       [--llama-server PATH] [--batch 1,16] [--reps 3] [--out FILE.json]
"""
import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 200, "maxItems": 200}
PROMPT = "List two hundred words as a JSON array."
TOKENS = 128


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=600):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_up(url, proc):
    for _ in range(1200):
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.1)
    sys.exit("server did not come up")


def one(url, constrained):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "words", "schema": SCHEMA}}
    r = post(url + "/v1/chat/completions", body)
    return r["usage"]["completion_tokens"]


def batch_rate(url, b, constrained, reps):
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(b) as pool:
            tokens = sum(pool.map(lambda _: one(url, constrained), range(b)))
        best = max(best, tokens / (time.perf_counter() - t))
    return best


def measure(name, args, url, batches, reps):
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(url, proc)
        one(url, True)  # warm-up (and grammar compilation caches)
        rows = []
        for b in batches:
            plain = batch_rate(url, b, False, reps)
            con = batch_rate(url, b, True, reps)
            rows.append({"server": name, "batch": b, "plain_tok_s": plain, "json_schema_tok_s": con,
                         "ratio": con / plain})
            print(f"{name} batch {b}: plain {plain:.1f} tok/s, json_schema {con:.1f} tok/s", file=sys.stderr)
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdserve", default="target/release/pdserve")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    batches = [int(x) for x in a.batch.split(",")]
    model = subprocess.run([a.pdserve, "pull"], capture_output=True, text=True, check=True).stdout.strip()
    peer = a.llama_server or os.path.join(
        subprocess.run(["scripts/build-peer.sh"], capture_output=True, text=True, check=True).stdout.strip(),
        "llama-server")
    rows = []
    port = free_port()
    rows += measure("pdserve", [a.pdserve, "serve", "--mode", "aggregated", "--threads-per-worker", "1",
                                "--port", str(port)], f"http://127.0.0.1:{port}", batches, a.reps)
    port = free_port()
    slots = max(batches)
    rows += measure("llama-server", [peer, "-m", model, "-t", "1", "-tb", "1", "--port", str(port),
                                     "-np", str(slots), "-c", str(slots * 512), "--no-webui"],
                    f"http://127.0.0.1:{port}", batches, a.reps)
    print("| server | batch | plain tok/s | json_schema tok/s | constrained / plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['json_schema_tok_s']:.1f} | "
              f"{r['ratio']:.3f} |")
    for b in batches:
        ours = next(r for r in rows if r["server"] == "pdserve" and r["batch"] == b)
        peer_row = next(r for r in rows if r["server"] == "llama-server" and r["batch"] == b)
        print(f"batch {b}: pdserve json_schema / llama-server json_schema = "
              f"{ours['json_schema_tok_s'] / peer_row['json_schema_tok_s']:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
