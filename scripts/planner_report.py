#!/usr/bin/env python3
"""The planner's table: goodput and SLO attainment per phase and over the whole run,
role switches and failed requests, for each topology of a `--phase` run, with the
hindsight oracle (the best fixed topology of each phase, measured) and the planner's
ratios to it and to the best fixed topology over the whole run. Every topology is
offered the same requests, so ratios are ratios of requests that met the SLOs.

usage: planner_report.py DIR TOPOLOGY...   (reads DIR/TOPOLOGY.json, and the switch
count from DIR/TOPOLOGY.metrics or, for the simulator, DIR/TOPOLOGY.log)
"""
import json
import os
import re
import sys


def load(out, t):
    point = json.load(open(f"{out}/{t}.json"))["points"][0]
    phases = {p["span"]["label"]: p["summary"] for p in point["phases"]}
    return point["summary"], phases


def good(summary):
    return round(summary["slo_attainment_pct"] * summary["requests"] / 100)


def switches(out, t):
    m = f"{out}/{t}.metrics"
    if os.path.exists(m):
        text = open(m).read()
        return int(sum(float(v) for v in re.findall(r"^pdserve_planner_decisions_total\{[^}]*\} (\S+)", text, re.M)))
    log = f"{out}/{t}.log"
    return open(log).read().count("planner: switching roles") if os.path.exists(log) else 0


def main():
    out, tops = sys.argv[1], sys.argv[2:]
    res = {t: load(out, t) for t in tops}
    phases = list(res[tops[0]][1].keys())
    fixed = [t for t in tops if "planner" not in t]
    best = {p: max(fixed, key=lambda t: good(res[t][1][p])) for p in phases}
    oracle = {p: res[best[p]][1][p]["goodput"] for p in phases}
    oracle_good = {p: good(res[best[p]][1][p]) for p in phases}
    total_good = sum(oracle_good.values())
    cols = " | ".join(f"{p} goodput (SLO %)" for p in phases)
    print(f"| topology | {cols} | whole run goodput (SLO %) | good requests | failed | role switches |")
    print("|---|" + "---|" * (len(phases) + 4))
    for t in tops:
        whole, ph = res[t]
        cells = " | ".join(f'{ph[p]["goodput"]:.3f} ({ph[p]["slo_attainment_pct"]:.0f})' for p in phases)
        w = f'{whole["goodput"]:.3f} ({whole["slo_attainment_pct"]:.0f})'
        print(f'| {t} | {cells} | {w} | {good(whole)} | {whole["failed"]} | {switches(out, t)} |')
    cells = " | ".join(f"{oracle[p]:.3f} ({best[p]})" for p in phases)
    print(f"| oracle (best fixed per phase) | {cells} | — | {total_good} | — | — |")
    best_whole = max(fixed, key=lambda t: good(res[t][0]))
    for t in tops:
        if "planner" not in t:
            continue
        ratios = ", ".join(f"{p} {good(res[t][1][p]) / max(oracle_good[p], 1):.2f}" for p in phases)
        print(f"\n{t} ÷ oracle (good requests) per phase: {ratios}; whole run {good(res[t][0]) / max(total_good, 1):.2f}")
        print(f"{t} ÷ best fixed over the whole run ({best_whole}): {good(res[t][0]) / max(good(res[best_whole][0]), 1):.2f}")


if __name__ == "__main__":
    main()
