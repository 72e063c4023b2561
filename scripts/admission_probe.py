#!/usr/bin/env python3
"""Admission while one long prompt prefills: starts `pdserve serve` (defaults), sends
one warm-up request, then one cold 3,000-word prompt, and a 2-token probe every 0.5 s
while it runs; prints each probe's status and time, and how many were answered.

    python3 scripts/admission_probe.py ./target/release/pdserve [PORT]
"""
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who its now find long down day did get"
).split()


def post(base, body, timeout=300):
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    started = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, time.time() - started, None, r.read()
    except urllib.error.HTTPError as e:
        return e.code, time.time() - started, e.headers.get("retry-after"), e.read()


def wait_healthy(base):
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            return
        except Exception:
            time.sleep(0.5)
    sys.exit("the server never became healthy")


def main():
    exe, port = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "18731")
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([exe, "serve", "--port", port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(base)
        print("warm-up: status %d in %.2f s" % post(base, {"prompt": "Hello", "max_tokens": 4})[:2])
        random.seed(7)
        prompt = " ".join(random.choice(WORDS) for _ in range(3000))
        result = {}
        long = threading.Thread(target=lambda: result.update(long=post(base, {"prompt": prompt, "max_tokens": 1})))
        long.start()
        probes, t0 = [], time.time()
        while long.is_alive():
            status, took, retry_after, body = post(base, {"prompt": "hi", "max_tokens": 2}, timeout=120)
            message = "" if status == 200 else json.loads(body).get("error", {}).get("message", "")
            probes.append((round(time.time() - t0, 1), status, round(took, 2), retry_after, message[:90]))
            time.sleep(0.5)
        long.join()
        print("long prompt: status %d in %.2f s" % result["long"][:2])
        for p in probes:
            print("probe at %5.1f s: status %d in %.2f s, Retry-After %s %s" % p)
        answered = sum(1 for p in probes if p[1] == 200)
        print(f"probes: {answered} of {len(probes)} answered 200")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
