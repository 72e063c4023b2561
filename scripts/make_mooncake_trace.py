#!/usr/bin/env python3
"""Writes a synthetic trace in the Mooncake format (one JSON object per line:
timestamp ms, input_length, output_length, hash_ids of 512-token blocks).

No production trace can be fetched here, so this one is generated, seeded, with the
structure Mooncake's published conversation trace has: a few system prompts that
many sessions start with, and sessions whose turns resend their whole history, so a
later turn's hash ids extend an earlier turn's. Sessions start as a Poisson process
and their turns follow each other after a think time; lengths are scaled to a small
model on a small machine.

usage: make_mooncake_trace.py OUT [--sessions 40] [--seconds 240] [--seed 5]
"""
import argparse
import json
import random

BLOCK = 512


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=5)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    next_id = 0

    def fresh(n):
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    # System prompts of one or two blocks, shared by every session that uses them.
    systems = [fresh(rng.choice([1, 2])) for _ in range(a.system_prompts)]
    rows = []
    for _ in range(a.sessions):
        t = rng.uniform(0, a.seconds * 0.7) * 1000
        history = list(rng.choice(systems))
        tokens = len(history) * BLOCK
        for _turn in range(rng.randint(2, 6)):
            # A new user message of 64..700 tokens; the reply becomes history too.
            message = rng.randint(64, 700)
            out = rng.randint(16, 96)
            tokens += message
            full_blocks = tokens // BLOCK
            if full_blocks > len(history):
                history += fresh(full_blocks - len(history))
            rows.append({"timestamp": round(t), "input_length": tokens, "output_length": out,
                         "hash_ids": list(history[: (tokens + BLOCK - 1) // BLOCK])})
            tokens += out
            t += rng.uniform(5, 25) * 1000
            if tokens > 3500:
                break
    rows.sort(key=lambda r: r["timestamp"])
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} requests, {a.sessions} sessions, "
          f"mean input {sum(r['input_length'] for r in rows) / len(rows):.0f} tokens -> {a.out}")


if __name__ == "__main__":
    main()
