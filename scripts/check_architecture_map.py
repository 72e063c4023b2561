"""Fails when docs/ARCHITECTURE.md's crate table or its list of `Worker`
implementations no longer matches the code.

The crate table is the fenced block of lines `crates/<name>  <job>` under "## Crates":
exactly one line per folder in crates/, in any order. The implementations are the
fenced block under "## `Worker` implementations", lines `<file>  <Type>  <what>`:
exactly the `impl Worker for <Type>` (or `impl pdserve_protocol::Worker for`) blocks
in crates/. Run by scripts/test.sh; prints what differs and exits 1.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
IMPL = re.compile(r"^impl(?:<[^>]*>)?\s+(?:pdserve_protocol::)?Worker\s+for\s+(\w+)", re.M)


def block(text, heading):
    """The lines of the first fenced block after `heading`."""
    at = text.index(heading)
    start = text.index("```", at)
    start = text.index("\n", start) + 1
    return [line for line in text[start:text.index("```", start)].splitlines() if line.strip()]


def crates_in_docs(text):
    return {line.split()[0] for line in block(text, "\n## Crates\n")}


def crates_in_tree():
    return {f"crates/{p.name}" for p in (ROOT / "crates").iterdir() if (p / "Cargo.toml").exists()}


def impls_in_docs(text):
    return {tuple(line.split()[:2]) for line in block(text, "\n## `Worker` implementations\n")}


def impls_in_tree():
    found = set()
    for path in (ROOT / "crates").rglob("*.rs"):
        if "target" in path.parts:
            continue
        for name in IMPL.findall(path.read_text()):
            found.add((str(path.relative_to(ROOT)), name))
    return found


def differences(what, docs, tree):
    out = [f"{what}: in the code, missing from docs/ARCHITECTURE.md: {x}" for x in sorted(tree - docs)]
    return out + [f"{what}: in docs/ARCHITECTURE.md, not in the code: {x}" for x in sorted(docs - tree)]


def main():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    bad = differences("crate", crates_in_docs(text), crates_in_tree())
    bad += differences("Worker implementation", impls_in_docs(text), impls_in_tree())
    for line in bad:
        print(line)
    if bad:
        sys.exit(1)
    print("architecture map: ok")


if __name__ == "__main__":
    main()
