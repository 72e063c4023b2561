#!/usr/bin/env bash
# Runs a command while half of this machine's cores are kept busy by spinning
# loops, as on a user's machine that is doing something else: a test that waits
# must wait for a condition, not for a time that only a quiet machine keeps.
#
#   scripts/under_load.sh cargo test -p pdserve-cli --test fleet
set -euo pipefail
n=$(( $(nproc) / 2 ))
[ "$n" -ge 1 ] || n=1
pids=()
for _ in $(seq "$n"); do
    ( while :; do :; done ) &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
echo "under_load.sh: $n busy loop(s) beside: $*" >&2
"$@"
