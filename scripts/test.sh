#!/usr/bin/env bash
# Runs every test pdserve has: formatting, lints, unit, property, golden and
# integration tests on the real default model (fetched first if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

# The test profile is optimized (Cargo.toml), so the binary built here shares its
# dependencies with the test build below.
cargo build --profile test --bin pdserve
./target/debug/pdserve pull
# The end-to-end suite talks to `pdserve serve` through the official OpenAI SDK and
# checks /metrics with promtool (Debian's prometheus package) and the Prometheus
# client library's parser.
python3 -m pip install -q --disable-pip-version-check openai prometheus-client
if ! command -v promtool >/dev/null; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    install="$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus"
    $install >/dev/null || { $sudo apt-get update -q >/dev/null && $install >/dev/null; }
fi

cargo fmt --all --check
cargo clippy --workspace --all-targets --profile test -- -D warnings
# Library, binary and integration tests (there are no doc tests); the summary line
# at the end adds up every test binary's result.
log=$(mktemp)
set +e
cargo test --workspace --lib --bins --tests --no-fail-fast 2>&1 | tee "$log"
cargo_status=${PIPESTATUS[0]}
# `pdserve serve` in every mode, driven by the openai SDK and curl, stopped by SIGTERM.
python3 tests/e2e/test_openai.py ./target/debug/pdserve 2>&1 | tee -a "$log"
e2e_status=${PIPESTATUS[0]}
set -e
awk '/^test result:/ { p += $4; f += $6 } /^e2e: / { p += $2; f += $4 } END { printf "%d passed, %d failed\n", p, f }' "$log"
rm -f "$log"
[ "$cargo_status" -eq 0 ] && [ "$e2e_status" -eq 0 ]
