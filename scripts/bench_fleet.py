"""The fleet's numbers, measured on this machine with real processes and nats-server.

1. Discovery, over --trials trials: a worker joins (its first record written) ->
   the frontend routes a request to it; a worker killed (-9) or frozen (SIGSTOP) ->
   the frontend refuses for want of it (its set no longer holds it); a killed
   worker's record -> gone from the bucket (TTL).
2. The fleet path's cost: `pdserve bench load` against `frontend --nats` and
   `frontend --workers` over the same two workers, in turns.
3. Migration, over --migrations trials: a decode worker killed (-9) mid-stream ->
   the next token the client gets (from the other decode worker, after the prompt
   plus the tokens already sent were prefilled again), next to the time to first
   token of a fresh prompt as long as that (no cached prefix), on the same fleet.
4. Control calls over NATS request/reply instead of the direct connection: one
   control-sized message's round trip both ways (crates/fleet/examples/control_rtt.rs).

Usage: python3 scripts/bench_fleet.py [--pdserve target/release/pdserve] [--trials 20] [--migrations 5]
       [--only discovery,overhead,migration,control] [--out DIR]
Prints a Markdown summary; --out keeps the raw figures as JSON.
"""
import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child whose stderr lines are kept; `wait_for` blocks until one matches."""

    def __init__(self, args):
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "RUST_LOG": "info"})
        self.lines, self.cv = [], threading.Condition()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.p.stderr:
            with self.cv:
                self.lines.append((time.perf_counter(), line))
                self.cv.notify_all()

    def wait_for(self, needle, timeout=60):
        end = time.time() + timeout
        with self.cv:
            while True:
                for t, line in self.lines:
                    if needle in line:
                        return t, line
                left = end - time.time()
                if left <= 0 or self.p.poll() is not None:
                    raise RuntimeError(f"never logged {needle!r}: {''.join(l for _, l in self.lines[-5:])}")
                self.cv.wait(left)

    def addr(self):
        _, line = self.wait_for("at http://")
        return line.split("at http://")[1].split("/")[0]

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def status(url, max_tokens=1):
    body = json.dumps({"prompt": [504, 3575, 282], "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def until(cond, timeout=30, every=0.005):
    end = time.perf_counter() + timeout
    while not cond():
        if time.perf_counter() > end:
            raise RuntimeError("timed out")
        time.sleep(every)
    return time.perf_counter()


def fleet_ids(pdserve, nats):
    out = subprocess.run([pdserve, "fleet", "--json", "--nats", nats], capture_output=True, text=True, check=True)
    return [r["node_id"] for r in json.loads(out.stdout)]


def worker(pdserve, nats, role, node_id):
    return Proc([pdserve, "worker", "--role", role, "--listen", "127.0.0.1:0", "--threads", "1", "--insecure",
                 "--nats", nats, "--node-id", node_id])


def discovery(pdserve, nats, trials):
    fe = Proc([pdserve, "frontend", "--nats", nats, "--insecure", "--mode", "aggregated", "--port", "0"])
    url = "http://" + fe.addr()
    out = {"join_s": [], "kill_out_s": [], "freeze_out_s": [], "record_expired_s": []}
    try:
        for i in range(trials):
            freeze = i % 2 == 1
            w = worker(pdserve, nats, "mixed", f"trial-{i}")
            t0, _ = w.wait_for("registered in the fleet")
            out["join_s"].append(until(lambda: status(url) == 200) - t0)
            if freeze:
                t1 = time.perf_counter()
                w.p.send_signal(signal.SIGSTOP)
                out["freeze_out_s"].append(until(lambda: status(url) == 503) - t1)
                w.p.send_signal(signal.SIGKILL)
            else:
                t1 = time.perf_counter()
                w.p.kill()
                out["kill_out_s"].append(until(lambda: status(url) == 503) - t1)
                out["record_expired_s"].append(until(lambda: not fleet_ids(pdserve, nats), every=0.05) - t1)
            w.stop()
            until(lambda: not fleet_ids(pdserve, nats), every=0.1)
    finally:
        fe.stop()
    return out


def load(pdserve, url, out):
    subprocess.run([pdserve, "bench", "load", "--url", url, "--concurrency", "1,8", "--input-len", "512",
                    "--output-len", "64", "--requests", "32", "--seed", "7", "--out", out],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def overhead(pdserve, nats, tmp, rounds):
    p, d = worker(pdserve, nats, "prefill", "p-0"), worker(pdserve, nats, "decode", "d-0")
    addrs = []
    for w in (p, d):
        _, line = w.wait_for("listening on ")
        addrs.append(line.split("listening on ")[1].split(",")[0].strip())
    common = ["--insecure", "--mode", "disaggregated", "--kv-transport", "tcp", "--port", "0"]
    fronts = {
        "workers": Proc([pdserve, "frontend", "--workers", ",".join(addrs)] + common),
        "nats": Proc([pdserve, "frontend", "--nats", nats] + common),
    }
    try:
        urls = {k: "http://" + f.addr() for k, f in fronts.items()}
        for u in urls.values():
            until(lambda: status(u) == 200)
        res = {k: [] for k in fronts}
        for r in range(rounds):
            for k, u in urls.items():
                res[k].append(load(pdserve, u, os.path.join(tmp, f"{k}-{r}.json")))
        return res
    finally:
        for f in fronts.values():
            f.stop()
        p.stop()
        d.stop()


def stream(url, prompt, max_tokens, stamps):
    """Streams a greedy completion, appending each text event's arrival time."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    for raw in conn.getresponse():
        line = raw.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            stamps.append(time.perf_counter())


def running_decoder(pdserve, nats):
    out = subprocess.run([pdserve, "fleet", "--json", "--nats", nats], capture_output=True, text=True, check=True)
    busy = [r["node_id"] for r in json.loads(out.stdout) if r["role"] == "decode" and r["load"]["running"] > 0]
    return busy[0] if busy else None


def migration(pdserve, nats, trials, prompt_len=512, kill_after=200, max_tokens=400):
    """Kill -> next token of a migrated stream, and a fresh prefill of the same length."""
    fe = Proc([pdserve, "frontend", "--nats", nats, "--insecure", "--mode", "disaggregated", "--kv-transport", "tcp",
               "--port", "0"])
    url = "http://" + fe.addr()
    prefill = worker(pdserve, nats, "prefill", "mig-p")
    decoders = {f"mig-d{i}": worker(pdserve, nats, "decode", f"mig-d{i}") for i in range(2)}
    out = {"kill_to_next_token_s": [], "fresh_prefill_ttft_s": [], "tokens_before_kill": []}
    try:
        until(lambda: len([i for i in fleet_ids(pdserve, nats) if i.startswith("mig-")]) == 3, every=0.1)
        until(lambda: status(url) == 200)
        for t in range(trials + 1):
            prompt = [1000 + (i * 37 + t * 101) % 20000 for i in range(prompt_len)]
            stamps = []
            th = threading.Thread(target=stream, args=(url, prompt, max_tokens, stamps))
            th.start()
            until(lambda: len(stamps) >= kill_after, timeout=120, every=0.001)
            victim = None
            while victim is None:
                victim = running_decoder(pdserve, nats)
            killed_at = time.perf_counter()
            decoders.pop(victim).stop()
            before = sum(1 for s in stamps if s <= killed_at)
            th.join()
            after = [b for a, b in zip(stamps, stamps[1:]) if b > killed_at]
            gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > killed_at]
            resumed = after[gaps.index(max(gaps))]
            # A fresh prompt as long as the replayed one, max_tokens 1: its TTFT.
            fresh = [1000 + (i * 53 + t * 211 + 7) % 20000 for i in range(prompt_len + before)]
            t0 = time.perf_counter()
            stream(url, fresh, 1, [])
            fresh_s = time.perf_counter() - t0
            name = f"mig-d{len(decoders) + t + 2}"
            decoders[name] = worker(pdserve, nats, "decode", name)
            decoders[name].wait_for("registered in the fleet")
            until(lambda: status(url) == 200)
            if t == 0:
                continue  # warm-up
            out["kill_to_next_token_s"].append(resumed - killed_at)
            out["fresh_prefill_ttft_s"].append(fresh_s)
            out["tokens_before_kill"].append(before)
    finally:
        for w in [fe, prefill, *decoders.values()]:
            w.stop()
    return out


def control(nats):
    """Round trips of 200 B and 2 KB messages: direct TCP vs NATS request/reply."""
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "pdserve-fleet", "--example", "control_rtt"], check=True)
    runs = [subprocess.run(["target/release/examples/control_rtt", nats, str(b), "2000"], capture_output=True,
                           text=True, check=True).stdout for b in (200, 2048)]
    return [json.loads(r) for r in runs]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdserve", default="target/release/pdserve")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--migrations", type=int, default=5)
    ap.add_argument("--only", default="discovery,overhead,migration,control")
    ap.add_argument("--out")
    a = ap.parse_args()
    nats_bin = subprocess.run(["scripts/nats.sh", "install"], capture_output=True, text=True, check=True).stdout.strip()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        nats = subprocess.Popen([nats_bin, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", tmp],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"nats://127.0.0.1:{port}"
        try:
            until(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0)
            only = a.only.split(",")
            disc = discovery(a.pdserve, url, a.trials) if "discovery" in only else {}
            over = overhead(a.pdserve, url, tmp, a.rounds) if "overhead" in only else {}
            mig = migration(a.pdserve, url, a.migrations) if "migration" in only else {}
            ctl = control(url) if "control" in only else []
        finally:
            nats.kill()
    if ctl:
        print("| control round trip | bytes | p50 | p99 |\n|---|---|---|---|")
        for r in ctl:
            for k in ["direct_tcp", "nats_request_reply"]:
                print(f"| {k} | {r['bytes']} | {r[k]['p50_us']:.0f} µs | {r[k]['p99_us']:.0f} µs |")
        print()
    if mig:
        print("| migration | trials | p50 | max |\n|---|---|---|---|")
        for k in ["kill_to_next_token_s", "fresh_prefill_ttft_s"]:
            xs = mig[k]
            print(f"| {k} | {len(xs)} | {statistics.median(xs) * 1000:.0f} ms | {max(xs) * 1000:.0f} ms |")
        print(f"(tokens streamed before the kill: {mig['tokens_before_kill']})\n")
    print("| discovery | trials | p50 | max |\n|---|---|---|---|")
    for k, xs in disc.items():
        print(f"| {k} | {len(xs)} | {statistics.median(xs) * 1000:.0f} ms | {max(xs) * 1000:.0f} ms |")
    print("\n| frontend | C | TTFT p50 | TTFT p99 | output tok/s |\n|---|---|---|---|---|")
    rows = {}
    for k, runs in over.items():
        for run in runs:
            for point in run["points"]:
                rows.setdefault((k, point["plan"]["label"]), []).append(point["summary"])
    for (k, c), pts in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        p50 = statistics.median(p["ttft_ms"]["p50"] for p in pts)
        p99 = statistics.median(p["ttft_ms"]["p99"] for p in pts)
        tps = statistics.median(p["output_token_throughput"] for p in pts)
        print(f"| --{k} | {c} | {p50:.1f} ms | {p99:.1f} ms | {tps:.1f} |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "fleet.json"), "w") as f:
            load_points = {k: [[p["summary"] | {"label": p["plan"]["label"]} for p in r["points"]] for r in v]
                           for k, v in over.items()}
            json.dump({"discovery": disc, "load": load_points, "migration": mig, "control": ctl}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
