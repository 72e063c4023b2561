#!/usr/bin/env python3
"""Tabulates the twin's predictions against measurements: for every *.real.json in a
directory (bench load's output) and its *.sim.json (pdserve sim's), the error of each
summary field per point (and the requests each shed with a 429), the median
absolute errors, and how the topologies rank by
goodput per workload and concurrency (Spearman's rho; the predicted best's measured
goodput against the measured best's), and goodput's error at other objectives than
the run's, recounted from the same requests. Several directories (e.g. runs at different
concurrencies) are tabulated together. Repeated measurements of a configuration
(NAME.real-2.json, NAME.real-3.json, ... beside NAME.real.json, as twin-fidelity.sh
writes with REPEATS) are averaged field by field before comparing, and the ranking
is also given for each repeat alone, so the spread between single runs shows.

usage: twin_fidelity.py DIR [DIR ...] [--sims SIM_DIR]
(--sims: the *.sim.json files come from SIM_DIR, e.g. the same runs simulated on
another profile.)"""
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


def repeats(real_path, name):
    """The measured runs of one configuration: NAME.real.json, then NAME.real-N.json."""
    extra = sorted(real_path.parent.glob(name + ".real-*.json"),
                   key=lambda p: int(p.name[len(name) + len(".real-"): -len(".json")]))
    return [json.loads(p.read_text()) for p in [real_path, *extra]]


def mean_of(points, get):
    """A summary field (`get`) averaged over repeated runs of one point."""
    return statistics.mean(get(p["summary"]) for p in points)


def main(dirs, sims=None):
    rows, errors, groups, pairs = [], {f: [] for f, _ in FIELDS}, {}, []
    noise = {f: [] for f, _ in FIELDS}
    n_runs = 1
    for real_path in sorted(p for d in dirs for p in Path(d).glob("*.real.json")):
        name = real_path.name[: -len(".real.json")]
        topo, work = name.split("-", 1)
        sim_path = Path(sims) / (name + ".sim.json") if sims else real_path.with_name(name + ".sim.json")
        sim = json.loads(sim_path.read_text())
        reals = repeats(real_path, name)
        n_runs = max(n_runs, len(reals))
        for i, sp in enumerate(sim["points"]):
            rps = [r["points"][i] for r in reals]
            label = rps[0]["plan"]["label"]
            pairs.append((topo, work, label, rps, sp))
            ss = sp["summary"]
            run_to_run(rps, noise)
            cells = []
            for f, get in FIELDS:
                real = mean_of(rps, get)
                e = err(get(ss), real)
                if e is not None:
                    errors[f].append(abs(e))
                cells.append(f"{real:.1f} → {get(ss):.1f} ({e * 100:+.1f} %)" if e is not None else "n/a")
            cells.append(f"{mean_of(rps, lambda s: s.get('shed', 0)):g} → {ss.get('shed', 0)}")
            spread = [p["summary"]["goodput"] for p in rps]
            cells.append(" / ".join(f"{g:.3f}" for g in spread))
            rows.append(f"| {topo} | {work} | {label} | " + " | ".join(cells) + " |")
            groups.setdefault((work, label), []).append((topo, statistics.mean(spread), ss["goodput"], spread))
    if n_runs > 1:
        print(f"Measured figures are the mean of {n_runs} runs of each configuration.\n")
    print("| topology | workload | point | " + " | ".join(f"{f} measured → predicted" for f, _ in FIELDS)
          + " | shed (429) measured → predicted | measured goodput, each run |")
    print("|---|---|---|" + "---|" * (len(FIELDS) + 2))
    print("\n".join(rows))
    print(f"\n{len(rows)} configurations. Median absolute error:\n")
    print("| measure | median abs error | max abs error |\n|---|---|---|")
    for f, _ in FIELDS:
        e = errors[f]
        if e:
            print(f"| {f} | {statistics.median(e) * 100:.1f} % | {max(e) * 100:.1f} % |")
    if n_runs > 1:
        print("\nThe measurements' own spread: each run against the mean of the other runs of its"
              " configuration (what one real run would miss by, predicting the rest):\n")
        print("| measure | median abs difference | max abs difference |\n|---|---|---|")
        for f, _ in FIELDS:
            if noise[f]:
                print(f"| {f} | {statistics.median(noise[f]) * 100:.1f} % | {max(noise[f]) * 100:.1f} % |")
    print("\nRanking of the topologies by goodput, per workload and point"
          + (" (measured: the mean of the runs)" if n_runs > 1 else "") + ":\n")
    print("| workload | point | measured best | predicted best | its measured goodput vs best | Spearman rho |")
    print("|---|---|---|---|---|---|")
    rhos, gaps, ties = ranking(groups, lambda c: c[1], show=True)
    if rhos:
        print(f"\nMean Spearman rho {statistics.mean(rhos):.2f}; the predicted best reaches "
              f"{min(gaps) * 100:.1f} % of the measured best at worst, {statistics.mean(gaps) * 100:.1f} % on average.")
    if ties:
        _, worst, _ = ranking(groups, lambda c: c[1], worst_of_tie=True)
        print(f"{ties} of {len(gaps)} groups are a tie for the predicted best (the first listed is the pick); "
              f"counting each tie at the worse of the tied topologies, the predicted best reaches "
              f"{min(worst) * 100:.1f} % at worst, {statistics.mean(worst) * 100:.1f} % on average.")
    if n_runs > 1 and all(len(c[3]) == n_runs for cands in groups.values() for c in cands):
        print("\nThe same ranking against each run alone:\n")
        print("| run | mean Spearman rho | predicted best vs measured best: worst | mean |\n|---|---|---|---|")
        for k in range(n_runs):
            rhos, gaps, _ = ranking(groups, lambda c, k=k: c[3][k])
            print(f"| {k + 1} | {statistics.mean(rhos):.2f} | {min(gaps) * 100:.1f} % | {statistics.mean(gaps) * 100:.1f} % |")
        print("\nOne real run as the advisor instead of the twin (its best topology, and its order,"
              " against the mean of the other runs):\n")
        print("| run | mean Spearman rho | its best vs measured best: worst | mean |\n|---|---|---|---|")
        for k, (rhos, gaps) in enumerate(advisors(groups, n_runs)):
            print(f"| {k + 1} | {statistics.mean(rhos):.2f} | {min(gaps) * 100:.1f} % | {statistics.mean(gaps) * 100:.1f} % |")
    slo_grid(pairs)


def run_to_run(points, noise):
    """Adds to `noise` each run's relative difference from the mean of the others."""
    if len(points) < 2:
        return
    for k, p in enumerate(points):
        others = points[:k] + points[k + 1:]
        for f, get in FIELDS:
            e = err(get(p["summary"]), mean_of(others, get))
            if e is not None:
                noise[f].append(abs(e))


# The order in which `pdserve plan` lists the topologies of two nodes.
PLAN_ORDER = ["agg2", "agg1", "1P1D", "auto2M"]


def ranking(groups, measured, show=False, predicted=lambda c: c[2], worst_of_tie=False):
    """Spearman's rho and the predicted best's share of the measured best, per group
    of topologies at one workload and point; `measured` picks a candidate's measured
    goodput, `predicted` its predicted one (the twin's, by default). Where several
    topologies tie for the predicted best (the twin gives `agg2` and `auto2M` the same
    figures when `auto` prefills nothing remotely), the pick is `pdserve plan`'s: it
    lists the aggregated fleet first, one node alone next, the splits, then `auto`,
    and keeps that order on a tie. `worst_of_tie` counts the worse of the tied
    topologies by measurement instead. Returns the rhos, the gaps, and how many groups
    were a tie."""
    rhos, gaps, ties = [], [], 0
    for (work, label), cands in sorted(groups.items()):
        if len(cands) < 2:
            continue
        best_real = max(cands, key=measured)
        top = max(predicted(c) for c in cands)
        tied = sorted((c for c in cands if predicted(c) >= top * (1 - 1e-9)), key=lambda c: PLAN_ORDER.index(c[0]))
        best_pred = min(tied, key=measured) if worst_of_tie else tied[0]
        ties += len(tied) > 1
        gap = measured(best_pred) / measured(best_real) if measured(best_real) else 1.0
        rho = spearman([measured(c) for c in cands], [predicted(c) for c in cands])
        rhos.append(rho)
        gaps.append(gap)
        if show:
            names = " = ".join(c[0] for c in tied) + (" (tie)" if len(tied) > 1 else "")
            print(f"| {work} | {label} | {best_real[0]} | {names} | {gap * 100:.1f} % | {rho:.2f} |")
    return rhos, gaps, ties


def goodput_at(point, ttft_s, tpot_s):
    """Requests per second of `point` that met both objectives, from its records
    (as bench load counts them: a one-token answer has no TPOT to miss)."""
    good = sum(1 for r in point["records"]
               if r["ok"] and r["ttft_s"] <= ttft_s and (r.get("tpot_s") or 0.0) <= tpot_s)
    return good / point["summary"]["duration_s"]


def slo_grid(pairs):
    """Goodput's error at other objectives than the run's, from the same records: a
    goodput of almost nothing (an objective few requests meet) has a relative error
    that says little, so the error is shown against how many requests met them. The
    ranking is recounted at each objective too: an objective that sits on the
    measured TPOT or TTFT of some topologies splits their requests by noise, and
    their order with it."""
    print("\nGoodput at other objectives, from the same requests:\n")
    print("| TTFT ≤ | TPOT ≤ | configurations with a measured goodput | median abs error | max abs error "
          "| requests meeting both, measured (mean) | Spearman rho (mean) | pick vs best: worst (tie at its worse) "
          "| one real run as the advisor: rho, worst |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ttft_s in (5, 30, 60):
        for tpot_ms in (50, 100, 200):
            errs, met, groups = [], [], {}
            for topo, work, label, rps, sp in pairs:
                runs = [goodput_at(rp, ttft_s, tpot_ms / 1e3) for rp in rps]
                real = statistics.mean(runs)
                sim = goodput_at(sp, ttft_s, tpot_ms / 1e3)
                if real > 0:
                    errs.append(abs(sim - real) / real)
                rate = statistics.mean(rp["summary"]["request_throughput"] for rp in rps)
                met.append(real / rate if rate else 0.0)
                groups.setdefault((work, label), []).append((topo, real, sim, runs))
            if errs:
                print(f"| {ttft_s} s | {tpot_ms} ms | {len(errs)} of {len(pairs)} | {statistics.median(errs) * 100:.1f} % "
                      f"| {max(errs) * 100:.1f} % | {statistics.mean(met) * 100:.0f} % | {ranked(groups)} |")


def ranked(groups):
    """The ranking cells of `slo_grid`: the twin's, then one real run's at its worst."""
    rhos, gaps, _ = ranking(groups, lambda c: c[1])
    _, worst, _ = ranking(groups, lambda c: c[1], worst_of_tie=True)
    cells = f"{statistics.mean(rhos):.2f} | {min(gaps) * 100:.1f} % ({min(worst) * 100:.1f} %)"
    n = min(len(c[3]) for cands in groups.values() for c in cands)
    if n < 2:
        return cells + " | n/a"
    each = advisors(groups, n)
    return cells + f" | {min(statistics.mean(r) for r, _ in each):.2f}, {min(min(g) for _, g in each) * 100:.1f} %"


def advisors(groups, n_runs):
    """Each real run used as the advisor in place of the twin (its goodputs rank the
    topologies) against the mean of the other runs: (rhos, gaps) per run."""
    out = []
    for k in range(n_runs):
        rhos, gaps, _ = ranking(groups, lambda c, k=k: statistics.mean(c[3][:k] + c[3][k + 1:]),
                                predicted=lambda c, k=k: c[3][k])
        out.append((rhos, gaps))
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    sims = None
    if "--sims" in args:
        i = args.index("--sims")
        sims = args[i + 1]
        del args[i:i + 2]
    main(args or ["."], sims)
