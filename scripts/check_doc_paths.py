"""Fails when a document cites a repository path that does not exist.

Checked: every relative Markdown link in *.md files (resolved against the file's own
directory), and every `crates/...`, `docs/...`, `scripts/...` or `tests/...` path
named in *.md files and in `//!` module headers of Rust files (resolved against the
repository root). Run by scripts/test.sh; prints each broken citation and exits 1.
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:crates|docs|scripts|tests)/[\w./-]*[\w/])")


def tracked(pattern):
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", pattern],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split()]


def exists(p):
    return p.exists() or any(ch in str(p) for ch in "*{}<>")


def check_text(source, text, base):
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        if base is not None:
            for target in LINK.findall(line):
                if target.startswith(("http://", "https://", "#", "mailto:")):
                    continue
                path = target.split("#")[0]
                if path and not exists((base / path).resolve()):
                    bad.append(f"{source}:{n}: link to {target}")
        for path in PATH.findall(line):
            if not exists(ROOT / path.rstrip(".")):
                bad.append(f"{source}:{n}: {path}")
    return bad


def main():
    bad = []
    for md in tracked("*.md"):
        bad += check_text(md.relative_to(ROOT), md.read_text(), md.parent)
    for rs in tracked("*.rs"):
        header = "\n".join(l for l in rs.read_text().splitlines() if l.lstrip().startswith("//!"))
        bad += check_text(rs.relative_to(ROOT), header, None)
    for b in bad:
        print(f"missing path: {b}")
    print(f"doc paths: {'ok' if not bad else f'{len(bad)} broken'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
