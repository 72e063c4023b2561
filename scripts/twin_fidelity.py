#!/usr/bin/env python3
"""Tabulates the twin's predictions against measurements: for every *.real.json in a
directory (bench load's output) and its *.sim.json (pdserve sim's), the error of each
summary field per point (and the requests each shed with a 429), the median
absolute errors, and how the topologies rank by
goodput per workload and concurrency (Spearman's rho; the predicted best's measured
goodput against the measured best's), and goodput's error at other objectives than
the run's, recounted from the same requests. Several directories (e.g. runs at different
concurrencies) are tabulated together.

usage: twin_fidelity.py DIR [DIR ...]"""
import json
import statistics
import sys
from pathlib import Path

FIELDS = [
    ("output tok/s", lambda s: s["output_token_throughput"]),
    ("TPOT p50", lambda s: s["tpot_ms"]["p50"]),
    ("TTFT mean", lambda s: s["ttft_ms"]["mean"]),
    ("TTFT p90", lambda s: s["ttft_ms"]["p90"]),
    ("goodput", lambda s: s["goodput"]),
]


def err(pred, real):
    return None if not real else (pred - real) / real


def ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a, b):
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else 1.0


def main(dirs):
    rows, errors, groups, pairs = [], {f: [] for f, _ in FIELDS}, {}, []
    for real_path in sorted(p for d in dirs for p in Path(d).glob("*.real.json")):
        name = real_path.name[: -len(".real.json")]
        topo, work = name.split("-", 1)
        sim = json.loads(real_path.with_name(name + ".sim.json").read_text())
        real = json.loads(real_path.read_text())
        for rp, sp in zip(real["points"], sim["points"]):
            label = rp["plan"]["label"]
            pairs.append((rp, sp))
            rs, ss = rp["summary"], sp["summary"]
            cells = []
            for f, get in FIELDS:
                e = err(get(ss), get(rs))
                if e is not None:
                    errors[f].append(abs(e))
                cells.append(f"{get(rs):.1f} → {get(ss):.1f} ({e * 100:+.1f} %)" if e is not None else "n/a")
            cells.append(f"{rs.get('shed', 0)} → {ss.get('shed', 0)}")
            rows.append(f"| {topo} | {work} | {label} | " + " | ".join(cells) + " |")
            groups.setdefault((work, label), []).append((topo, rs["goodput"], ss["goodput"]))
    print("| topology | workload | point | " + " | ".join(f"{f} measured → predicted" for f, _ in FIELDS)
          + " | shed (429) measured → predicted |")
    print("|---|---|---|" + "---|" * (len(FIELDS) + 1))
    print("\n".join(rows))
    print(f"\n{len(rows)} configurations. Median absolute error:\n")
    print("| measure | median abs error | max abs error |\n|---|---|---|")
    for f, _ in FIELDS:
        e = errors[f]
        if e:
            print(f"| {f} | {statistics.median(e) * 100:.1f} % | {max(e) * 100:.1f} % |")
    print("\nRanking of the topologies by goodput, per workload and point:\n")
    print("| workload | point | measured best | predicted best | its measured goodput vs best | Spearman rho |")
    print("|---|---|---|---|---|---|")
    rhos, gaps = [], []
    for (work, label), cands in sorted(groups.items()):
        if len(cands) < 2:
            continue
        best_real = max(cands, key=lambda c: c[1])
        best_pred = max(cands, key=lambda c: c[2])
        gap = best_pred[1] / best_real[1] if best_real[1] else 1.0
        rho = spearman([c[1] for c in cands], [c[2] for c in cands])
        rhos.append(rho)
        gaps.append(gap)
        print(f"| {work} | {label} | {best_real[0]} | {best_pred[0]} | {gap * 100:.1f} % | {rho:.2f} |")
    if rhos:
        print(f"\nMean Spearman rho {statistics.mean(rhos):.2f}; the predicted best reaches "
              f"{min(gaps) * 100:.1f} % of the measured best at worst, {statistics.mean(gaps) * 100:.1f} % on average.")
    slo_grid(pairs)


def goodput_at(point, ttft_s, tpot_s):
    """Requests per second of `point` that met both objectives, from its records
    (as bench load counts them: a one-token answer has no TPOT to miss)."""
    good = sum(1 for r in point["records"]
               if r["ok"] and r["ttft_s"] <= ttft_s and (r.get("tpot_s") or 0.0) <= tpot_s)
    return good / point["summary"]["duration_s"]


def slo_grid(pairs):
    """Goodput's error at other objectives than the run's, from the same records: a
    goodput of almost nothing (an objective few requests meet) has a relative error
    that says little, so the error is shown against how many requests met them."""
    print("\nGoodput at other objectives, from the same requests:\n")
    print("| TTFT ≤ | TPOT ≤ | configurations with a measured goodput | median abs error | max abs error "
          "| requests meeting both, measured (mean) |")
    print("|---|---|---|---|---|---|")
    for ttft_s in (5, 30, 60):
        for tpot_ms in (50, 100, 200):
            errs, met = [], []
            for rp, sp in pairs:
                real, sim = goodput_at(rp, ttft_s, tpot_ms / 1e3), goodput_at(sp, ttft_s, tpot_ms / 1e3)
                if real > 0:
                    errs.append(abs(sim - real) / real)
                rate = rp["summary"]["request_throughput"]
                met.append(real / rate if rate else 0.0)
            if errs:
                print(f"| {ttft_s} s | {tpot_ms} ms | {len(errs)} of {len(pairs)} | {statistics.median(errs) * 100:.1f} % "
                      f"| {max(errs) * 100:.1f} % | {statistics.mean(met) * 100:.0f} % |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
