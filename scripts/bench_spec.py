"""Speculative decoding against none, on one server: TPOT of streamed chat replies.

Workloads (each a chat request, greedy, `max_tokens` OUT, `ignore_eos`):
  code:    return a source file of this repository whole, with one line added;
  quote:   quote a passage of Hamlet (scripts/fetch-text.sh) exactly;
  extract: pull fields out of a text as JSON;
  open:    open-ended chat.
Every request of a workload has its own prompt (another file, passage, person or
story), the same list on every server run: greedy requests with one prompt would write
one text, and a request could draft what another wrote before it, which no two users'
requests do.
At each concurrency C, C clients each send REQUESTS requests of one workload back to
back. TPOT = (last token time - first token time) / (tokens - 1), one per request.
Prints one JSON line per (workload, C): TPOT p50/p99 in ms and output tok/s.

Usage: bench_spec.py URL LABEL TEXT_FILE [C,C..] [REQUESTS] [OUT]
"""
import glob
import http.client
import itertools
import json
import sys
import threading
import time
import urllib.parse

ROOT = __file__.rsplit("/scripts/", 1)[0]

NAMES = ["Maria Lopez", "Jonas Berg", "Aiko Tanaka", "Omar Haddad", "Lena Novak", "Kofi Mensah", "Sofia Rossi",
         "Ravi Iyer", "Emma Dubois", "Tomas Silva", "Nadia Petrova", "Liam Walsh", "Mei Chen", "Pedro Alves",
         "Hana Kim", "Youssef Amari"]
CITIES = ["Lisbon", "Porto", "Oslo", "Bergen", "Osaka", "Kyoto", "Beirut", "Tunis", "Prague", "Brno", "Accra",
          "Kumasi", "Turin", "Genoa", "Pune", "Lyon", "Nantes", "Recife", "Natal", "Busan"]
TRADES = ["a bakery", "a bike shop", "a tea house", "a bookshop", "a pottery studio", "a flower stall",
          "a repair shop", "a print shop"]
STORIES = ["a lighthouse keeper who finds a message in a bottle", "a clockmaker whose clocks run backwards",
           "a girl who can talk to rivers", "a robot that learns to bake bread", "two rival chess players stuck in "
           "a lift", "a fox that runs a post office", "an astronaut who loses her keys on the moon",
           "a village where it never stops snowing", "a detective who is afraid of the dark",
           "a painter who paints only doors", "a dragon who collects teacups", "a ship's cat on its last voyage",
           "a librarian who finds a book with no ending", "a beekeeper and a storm", "a boy who builds a kite "
           "from maps", "a grandmother who was once a pilot", "a town band that forgot its song",
           "a gardener growing a tree of glass"]


def workloads(text_file):
    """Each workload's prompts, as an endless list (request k takes the k-th)."""
    files = sorted(glob.glob(f"{ROOT}/crates/*/src/*.rs"))
    hamlet = open(text_file).read()
    start = hamlet.index("To be, or not to be")

    def code(k):
        src = open(files[k % len(files)]).read()[:3000]
        return (f"Here is a Rust file.\n\n```rust\n{src}\n```\n\nReturn the whole file unchanged except for "
                "one line `// Reviewed.` added at its top. Output only the code.")

    def quote(k):
        at = start + (k * 1500) % (len(hamlet) - start - 1500)
        at = hamlet.index("\n", at) + 1
        return f"Here is a passage from Hamlet.\n\n{hamlet[at:at + 1500]}\n\nQuote the passage exactly, from the start."

    def extract(k):
        name, frm, to = NAMES[k % len(NAMES)], CITIES[k % len(CITIES)], CITIES[(3 * k + 7) % len(CITIES)]
        facts = (f"{name}, {24 + k % 40}, moved from {frm} to {to} in {2001 + k % 24}. They run {TRADES[k % len(TRADES)]} "
                 f"on Main Street {3 + k} and employ {2 + k % 9} people. Their phone number is +1 555 {1000 + 37 * k}.")
        return (f"{facts}\n\nReturn JSON with the fields name, age, from_city, to_city, business, street, "
                "employees and phone, each copied from the text.")

    def story(k):
        return f"Tell me a story about {STORIES[k % len(STORIES)]}."

    return {"code": code, "quote": quote, "extract": extract, "open": story}


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


def point(url, prompts, c, n, out):
    """C clients, n requests each, each request the next of `prompts`."""
    results, lock = [], threading.Lock()

    def client():
        for _ in range(n):
            with lock:
                prompt = next(prompts)
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
    for name, make in workloads(text).items():
        prompts = map(make, itertools.count())
        one(url, next(prompts), 8)  # warm-up: the step fit started
        for c in conc:
            r = point(url, prompts, c, n, out)
            print(json.dumps({"label": label, "workload": name, "concurrency": c, **r}), flush=True)


if __name__ == "__main__":
    main()
