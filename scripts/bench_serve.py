"""Closed-loop load against an OpenAI-compatible server (pdserve, llama-server, vLLM).

Each request: ISL random token ids (a fixed seed, a different prompt per request),
exactly OSL tokens out (greedy, `ignore_eos`), streamed. At each concurrency C, C
clients send requests back to back until `--requests` (default max(2C, 4)) are done.

Metrics: TTFT = request sent -> first streamed token; TPOT = (last - first token time)
/ (tokens - 1); output tok/s = all output tokens / wall time of the level.
Prints one JSON line per level. (pdserve's own `bench load` will replace this script.)

With `--peaks` (pdserve only) it also polls `/metrics` every 0.1 s and reports the most
requests its workers ran at once and the most KV blocks they held in use: how many
sequences a KV memory budget admitted.
"""
import argparse
import http.client
import json
import random
import re
import threading
import time
import urllib.parse


def one_request(url, prompt, osl, model):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"prompt": prompt, "max_tokens": osl, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    times, tokens = [], None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            tokens = chunk["usage"].get("completion_tokens")
        # A chunk with text marks a token's arrival (a closing chunk may carry none).
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            times.append(time.perf_counter())
    conn.close()
    return t0, times, tokens if tokens is not None else len(times)


class Peaks:
    """The largest running-request count and used-block count /metrics showed."""

    RUNNING = re.compile(r'^pdserve_worker_requests\{[^}]*state="running"[^}]*\} (\S+)$', re.M)
    USED = re.compile(r'^pdserve_kv_blocks\{[^}]*state="used",tier="device"[^}]*\} (\S+)$', re.M)

    def __init__(self, url):
        self.url, self.running, self.used = url, 0, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.poll)
        self.thread.start()

    def poll(self):
        u = urllib.parse.urlparse(self.url)
        while not self.done.wait(0.1):
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            conn.close()
            self.running = max(self.running, sum(float(v) for v in self.RUNNING.findall(text)))
            self.used = max(self.used, sum(float(v) for v in self.USED.findall(text)))

    def stop(self):
        self.done.set()
        self.thread.join()
        return {"peak_running": int(self.running), "peak_used_blocks": int(self.used)}


def level(url, c, n, isl, osl, vocab, model, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab) for _ in range(isl)] for _ in range(n)]
    lock = threading.Lock()
    results, errors = [], []
    next_i = [0]

    def client():
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= n:
                return
            try:
                results.append(one_request(url, prompts[i], osl, model))
            except Exception as e:  # a failed request is reported, not hidden
                errors.append(str(e))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = sorted(ts[0] - t0 for t0, ts, _ in results if ts)
    tpot = [(ts[-1] - ts[0]) / (n - 1) for _, ts, n in results if len(ts) > 1 and n > 1]
    tokens = sum(n for _, _, n in results)
    p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else float("nan")
    return {
        "concurrency": c, "requests": len(results), "errors": len(errors), "output_tok_s": tokens / wall,
        "ttft_mean_ms": 1000 * sum(ttft) / max(len(ttft), 1), "ttft_p99_ms": 1000 * p99,
        "tpot_mean_ms": 1000 * sum(tpot) / max(len(tpot), 1), "tokens": tokens,
        "requests_per_s": len(results) / wall, "first_error": errors[0] if errors else None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--label", default="server")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--model", default="")
    ap.add_argument("--peaks", action="store_true")
    a = ap.parse_args()
    for c in [int(x) for x in a.concurrency.split(",")]:
        n = a.requests or max(2 * c, 4)
        peaks = Peaks(a.url) if a.peaks else None
        r = level(a.url, c, n, a.isl, a.osl, a.vocab, a.model, seed=c)
        if peaks:
            r.update(peaks.stop())
        r["label"] = a.label
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
