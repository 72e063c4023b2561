"""Turns the outputs of scripts/bench-models.sh into one table per model (Markdown):
pdserve and llama.cpp in the same run, their ratio, and decode as a share of the
memory-read roofline (the file's decode weight bytes × tok/s ÷ read bandwidth)."""
import json
import sys
from pathlib import Path

out, models = Path(sys.argv[1]), sys.argv[2:]


def rows_of(name):
    ours = json.loads((out / f"{name}-pdserve.json").read_text())
    bench = json.loads((out / f"{name}-llama-bench.json").read_text())
    batched = [json.loads(l) for l in (out / f"{name}-llama-batched.jsonl").read_text().splitlines() if l.strip()]
    weight = json.loads((out / f"{name}-file.json").read_text())["decode_weight_bytes"]
    bw = dict(ours["read_gb_per_s"])

    def mine(kind, t, prompt, batch):
        return next((r["tokens_per_s"] for r in ours["rows"]
                     if (r["kind"], r["threads"], r["prompt"], r["batch"]) == (kind, t, prompt, batch)), None)

    def peer(t, p, n):
        return next((e["avg_ts"] for e in bench if (e["n_threads"], e["n_prompt"], e["n_gen"]) == (t, p, n)), None)

    def peer_batched(t, pl):
        return next((e["speed_tg"] for e in batched if (e["threads"], e["pl"]) == (t, pl)), None)

    gen = next(e["n_gen"] for e in bench if e["n_gen"])
    print(f"### {name} ({ours['model']}, {weight / 1e6:.0f} MB of weights read per decode step)\n")
    print(f"pdserve kernels {ours['isa']}, {ours['weight_bytes'] / 1e6:.0f} MB of weights as repacked, "
          f"{ours['loaded_rss_mb']:.0f} MB resident once loaded (peak {ours['peak_rss_mb']:.0f} MB); "
          f"llama.cpp {bench[0].get('build_commit', '?')}; memory read "
          + ", ".join(f"{g:.1f} GB/s at {t} thread{'s' if t > 1 else ''}" for t, g in sorted(bw.items())) + ".\n")
    print("| measurement | threads | pdserve tok/s | llama.cpp tok/s | ratio | pdserve roofline | llama.cpp roofline |")
    print("|---|---|---|---|---|---|---|")
    for t in sorted(bw):
        lines = [(f"prefill pp512", mine("prefill", t, 512, 1), peer(t, 512, 0), False),
                 (f"decode tg{gen}", mine("decode", t, 1, 1), peer(t, 0, gen), True)]
        lines += [(f"decode, {b} sequences (aggregate)", mine("decode", t, 64, b), peer_batched(t, b), False) for b in (4, 16)]
        for what, a, b, roof in lines:
            if a is None or b is None:
                continue
            share = (lambda x: f"{100 * weight * x / (bw[t] * 1e9):.0f} %") if roof else (lambda x: "")
            print(f"| {what} | {t} | {a:.1f} | {b:.1f} | {a / b:.2f}× | {share(a)} | {share(b)} |")
    print()


for m in models:
    rows_of(m)
