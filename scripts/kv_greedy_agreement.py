#!/usr/bin/env python3
"""Greedy agreement of quantized KV caches with f16 on the golden prompts: for each
cache dtype, starts `pdserve serve --kv-cache-dtype D`, generates N greedy tokens for
every golden prompt, and reports how many tokens agree with the f16 run before the
first difference, and f16's margin between its top two tokens at that position (a
near-tie, where rounding decides, is a margin under 0.15).

Usage: kv_greedy_agreement.py PDSERVE GOLDEN.json [N]
"""
import json
import re
import subprocess
import sys
import urllib.request


def serve(pdserve, dtype):
    p = subprocess.Popen(
        [pdserve, "serve", "--mode", "aggregated", "--threads-per-worker", "2", "--port", "0", "--kv-cache-dtype", dtype],
        stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        m = re.search(r"http://([0-9.:]+)/v1", line)
        if m:
            return p, m.group(1)
    sys.exit(f"pdserve serve --kv-cache-dtype {dtype} did not start")


def generate(addr, prompt, n):
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                       "logprobs": 2}).encode()
    req = urllib.request.Request(f"http://{addr}/v1/completions", body, {"Content-Type": "application/json"})
    c = json.load(urllib.request.urlopen(req))["choices"][0]["logprobs"]
    margins = [sorted(t.values(), reverse=True) for t in c["top_logprobs"]]
    return c["tokens"], [m[0] - m[1] if len(m) > 1 else float("inf") for m in margins]


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    pdserve, golden = sys.argv[1], json.load(open(sys.argv[2]))
    n = int(sys.argv[3]) if len(sys.argv) == 4 else 32
    prompts = [g["prompt_ids"] for g in golden["greedy"]]
    runs = {}
    for dtype in ["f16", "q8_0", "q4_0"]:
        p, addr = serve(pdserve, dtype)
        try:
            runs[dtype] = [generate(addr, q, n) for q in prompts]
        finally:
            p.kill()
            p.wait()
    for dtype in ["q8_0", "q4_0"]:
        same, cells = 0, []
        for (ref, margins), (got, _) in zip(runs["f16"], runs[dtype]):
            k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
            same += k == len(ref)
            cells.append(f"{k}" if k == len(ref) else f"{k} (f16 margin {margins[k]:.2f})")
        print(f"{dtype}: {same}/{len(prompts)} prompts identical over {n} tokens; agreeing tokens: {', '.join(cells)}")


if __name__ == "__main__":
    main()
