#!/usr/bin/env python3
"""Import loops between the sibling modules of each crate, and among the CLI's commands.

A module that names another (`crate::other::...` outside comments and tests) depends on
it; a loop is a strongly connected set of two or more modules. The crate root is left
out (every module hangs from it), and so are test files (`tests.rs`, `*_tests.rs`) and
everything after a file's first `#[cfg(test)]`.

Known loops are listed in KNOWN with the reason they stand; the check fails on any
other loop, and on a known one that is gone (so the list shrinks as they are cut).
Run from the repository root: python3 scripts/check_import_loops.py
"""
import glob
import os
import re
import sys

# Loops that stand today, each a sorted tuple of modules, with why they were left.
KNOWN = {}


def modules(src):
    """Top-level module name -> its non-test files."""
    out = {}
    for path in glob.glob(src + "/**/*.rs", recursive=True):
        rel = os.path.relpath(path, src)
        base = os.path.basename(rel)
        if rel in ("lib.rs", "main.rs") or base == "tests.rs" or base.endswith("_tests.rs") or "/tests/" in rel:
            continue
        out.setdefault(rel[:-3].split("/")[0], []).append(path)
    return out


def code(path):
    text = open(path, encoding="utf-8").read().split("#[cfg(test)]")[0]
    return re.sub(r"//.*", "", text)


def loops(graph):
    """Strongly connected components of two or more nodes (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(tuple(sorted(comp)))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def main():
    seen = set()
    for src in sorted(glob.glob("crates/*/src")):
        mods = modules(src)
        graph = {m: set() for m in mods}
        for m, files in mods.items():
            for f in files:
                for t in re.findall(r"crate::(\w+)", code(f)):
                    if t in mods and t != m:
                        graph[m].add(t)
        for comp in loops(graph):
            seen.add((src, comp))
    cmds = {os.path.basename(p)[:-3]: p for p in glob.glob("crates/cli/src/cmd/*.rs")}
    graph = {n: {t for t in re.findall(r"super::(\w+)", code(p)) if t in cmds and t != n} for n, p in cmds.items()}
    for comp in loops(graph):
        seen.add(("crates/cli/src/cmd", comp))
    new = sorted(seen - KNOWN.keys())
    gone = sorted(KNOWN.keys() - seen)
    for src, comp in sorted(seen & KNOWN.keys()):
        print(f"known loop in {src}: {' <-> '.join(comp)} ({KNOWN[(src, comp)]})")
    for src, comp in new:
        print(f"new import loop in {src}: {' <-> '.join(comp)}")
    for src, comp in gone:
        print(f"loop gone, remove it from KNOWN: {src}: {' <-> '.join(comp)}")
    print(f"import loops: {len(seen)} ({len(new)} new, {len(gone)} gone from the known list)")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
