#!/usr/bin/env python3
"""The planner's table: goodput and SLO attainment per phase and over the whole run,
role switches and failed requests, for each topology of a `--phase` run, with the
hindsight oracle (the best fixed topology of each phase, measured) and the planner's
ratios to it and to the best fixed topology over the whole run. Every topology is
offered the same requests, so ratios are ratios of requests that met the SLOs.

A second table gives each planner's switches per phase and the time from the
phase's start (the shift) to its last switch there: how long the planner took to
reach the assignment it then held.

usage: planner_report.py DIR TOPOLOGY...   (reads DIR/TOPOLOGY.json, and the switch
count from DIR/TOPOLOGY.metrics or, for the simulator, DIR/TOPOLOGY.log; the switches'
times from the simulator's JSON, or from DIR/TOPOLOGY.server.log placed on the
point's clock by its `started_unix_s`)
"""
import datetime
import functools
import json
import os
import re
import sys


@functools.cache
def point_of(out, t):
    """The run's one point, read once: a simulator's JSON can be a hundred MB."""
    return json.load(open(f"{out}/{t}.json"))["points"][0]


def load(out, t):
    point = point_of(out, t)
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


SWITCH = re.compile(r'^(\S+Z)\s+INFO planner: switching roles from=(\S+) to=(\S+) reason="?(\w+)"?', re.M)


def switch_times(out, t):
    """The planner's switches as (seconds on the point's clock, from, to, reason)."""
    point = point_of(out, t)
    if point.get("switches"):
        return [(s["at_s"], s["from"], s["to"], s["reason"]) for s in point["switches"]]
    log, start = f"{out}/{t}.server.log", point.get("started_unix_s")
    if start is None or not os.path.exists(log):
        return []
    stamp = lambda s: datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    return [(stamp(ts) - start, a, b, r) for ts, a, b, r in SWITCH.findall(open(log).read())]


def spans(out, t):
    return [(p["span"]["label"], p["span"]["start_s"], p["span"]["end_s"]) for p in point_of(out, t)["phases"]]


def settling(out, t):
    """Per phase, the switches made in it as (seconds from the phase's start, from,
    to, reason)."""
    times = switch_times(out, t)
    return [[(at - start, a, b, r) for at, a, b, r in times if start <= at < end] for _, start, end in spans(out, t)]


def settle_table(out, planners):
    print("\nRole switches per phase (seconds after the phase began), and when the last of them came:\n")
    phases = [label for label, _, _ in spans(out, planners[0])]
    print(f"| topology | {' | '.join(phases)} |")
    print("|---|" + "---|" * len(phases))
    for t in planners:
        cells = []
        for inside in settling(out, t):
            moves = ", ".join(f"{a} → {b} ({r}) +{at:.1f} s" for at, a, b, r in inside)
            cells.append(f"{len(inside)}: {moves}; settled +{inside[-1][0]:.1f} s" if inside else "0")
        print(f"| {t} | {' | '.join(cells)} |")


def main():
    out, tops = sys.argv[1], sys.argv[2:]
    res = {t: load(out, t) for t in tops}
    phases = list(res[tops[0]][1].keys())
    fixed = [t for t in tops if "planner" not in t]
    if not fixed:  # planners alone: only their switches
        settle_table(out, tops)
        return
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
    planners = [t for t in tops if "planner" in t]
    if planners:
        settle_table(out, planners)


if __name__ == "__main__":
    main()
