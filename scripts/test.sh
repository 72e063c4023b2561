#!/usr/bin/env bash
# Runs every test pdserve has: formatting, lints, unit, property, golden and
# integration tests on the real default model (fetched first if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

# The test profile is optimized (Cargo.toml), so the binary built here shares its
# dependencies with the test build below.
cargo build --profile test --bin pdserve
./target/debug/pdserve pull

cargo fmt --all --check
cargo clippy --workspace --all-targets --profile test -- -D warnings
cargo test --workspace --no-fail-fast
