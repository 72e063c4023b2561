"""Turns the outputs of scripts/bench-engine.sh into one ratio table (Markdown)."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
ours = json.loads((out / "engine-pdserve.json").read_text())
bench = json.loads((out / "engine-llama-bench.json").read_text())
batched = [json.loads(line) for line in (out / "engine-llama-batched.jsonl").read_text().splitlines() if line.strip()]


def ours_at(kind, threads, prompt, batch):
    for r in ours["rows"]:
        if (r["kind"], r["threads"], r["prompt"], r["batch"]) == (kind, threads, prompt, batch):
            return r["tokens_per_s"]
    return None


def peer_bench(threads, n_prompt, n_gen):
    for e in bench:
        if e["n_threads"] == threads and e["n_prompt"] == n_prompt and e["n_gen"] == n_gen:
            return e["avg_ts"]
    return None


def peer_batched(threads, pl):
    for e in batched:
        if e["threads"] == threads and e["pl"] == pl:
            return e["speed_tg"]
    return None


rows = []
threads = sorted({r["threads"] for r in ours["rows"]})
for t in threads:
    for p in (128, 512, 2048):
        rows.append((f"prefill pp{p}", t, ours_at("prefill", t, p, 1), peer_bench(t, p, 0)))
    rows.append(("decode tg128 (empty context)", t, ours_at("decode", t, 1, 1), peer_bench(t, 0, 128)))
    for b in (1, 4, 16, 32):
        rows.append((f"decode after 512-token prompts, {b} seq (aggregate)", t, ours_at("decode", t, 512, b), peer_batched(t, b)))

print(f"model {ours['model']}, pdserve kernels {ours['isa']}, peak RSS {ours['peak_rss_mb']:.0f} MB, "
      f"llama.cpp {bench[0].get('build_commit', '?')} on {bench[0].get('cpu_info', '?')}\n")
print("| measurement | threads | pdserve tok/s | llama.cpp tok/s | ratio |")
print("|---|---|---|---|---|")
for name, t, a, b in rows:
    if a is None or b is None:
        continue
    print(f"| {name} | {t} | {a:.1f} | {b:.1f} | {a / b:.2f}× |")
