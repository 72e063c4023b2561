"""Speculative decoding against none, on one server: TPOT of streamed chat replies.

Workloads (each a chat request, greedy, `max_tokens` OUT, `ignore_eos`):
  code:    return a source file of this repository whole, with one name changed;
  quote:   quote a passage of Hamlet (scripts/fetch-text.sh) exactly;
  extract: pull fields out of a text as JSON;
  open:    open-ended chat.
At each concurrency C, C clients each send REQUESTS requests of one workload back to
back. TPOT = (last token time - first token time) / (tokens - 1), one per request.
Prints one JSON line per (workload, C): TPOT p50/p99 in ms and output tok/s.

Usage: bench_spec.py URL LABEL TEXT_FILE [C,C..] [REQUESTS] [OUT]
"""
import http.client
import json
import sys
import threading
import time
import urllib.parse

ROOT = __file__.rsplit("/scripts/", 1)[0]


def workloads(text_file):
    code = open(f"{ROOT}/crates/engine/src/batch/sequence.rs").read()[:3000]
    hamlet = open(text_file).read()
    passage = hamlet[hamlet.index("To be, or not to be"):][:1500]
    facts = ("Maria Lopez, 34, moved from Lisbon to Porto in 2019. She runs a bakery called Pao Quente on "
             "Rua das Flores 12 and employs six people. Her phone number is +351 912 345 678.")
    return {
        "code": f"Here is a Rust file.\n\n```rust\n{code}\n```\n\nReturn the whole file unchanged except that "
                "the struct `Sequence` is renamed `Request`. Output only the code.",
        "quote": f"Here is a passage from Hamlet.\n\n{passage}\n\nQuote the passage exactly, from the start.",
        "extract": f"{facts}\n\nReturn JSON with the fields name, age, from_city, to_city, business, street, "
                   "employees and phone, each copied from the text.",
        "open": "Tell me a story about a lighthouse keeper who finds a message in a bottle.",
    }


def one(url, prompt, out):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": out, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:200]
    times = []
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    conn.close()
    return times


def point(url, prompt, c, n, out):
    results, lock = [], threading.Lock()

    def client():
        for _ in range(n):
            t = one(url, prompt, out)
            with lock:
                results.append(t)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(c)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - start
    tpot = sorted((t[-1] - t[0]) / (len(t) - 1) for t in results if len(t) > 1)
    pct = lambda q: 1000 * tpot[min(len(tpot) - 1, int(q * len(tpot)))]
    return {"tpot_p50_ms": pct(0.5), "tpot_p99_ms": pct(0.99), "tok_s": sum(len(t) for t in results) / wall}


def main():
    url, label, text = sys.argv[1:4]
    conc = [int(c) for c in (sys.argv[4] if len(sys.argv) > 4 else "1,4").split(",")]
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    out = int(sys.argv[6]) if len(sys.argv) > 6 else 128
    for name, prompt in workloads(text).items():
        one(url, prompt, 8)  # warm-up: the prompt's prefix is cached, the step fit started
        for c in conc:
            r = point(url, prompt, c, n, out)
            print(json.dumps({"label": label, "workload": name, "concurrency": c, **r}), flush=True)


if __name__ == "__main__":
    main()
