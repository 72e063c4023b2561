# The rows of the KV tiers benchmark, sourced by bench-kv-tiers.sh (measured) and
# twin-tiers.sh (simulated) so both run the same topology: one two-thread worker, a
# 256-block pool, and below it nothing, a host tier, or a small host tier over a
# disk tier in "$disk". Sets `base` (flags of every row), `tiers` (each row's own
# flags) and `configs` (the rows, in order).
# A 256-block pool (4,096 tokens) holds about three 1,024-token prefixes next to the
# running requests: the workload's 16 are five times that.
# shellcheck disable=SC2034  # used by the scripts that source this file
base=(--mode aggregated --workers 1 --threads-per-worker 2 --kv-blocks 256 --policy kv-aware)
# shellcheck disable=SC2034
declare -A tiers=(
  [pool-only]=""
  [host]="--kv-host-gb 0.5"
  [host+disk]="--kv-host-gb 0.1 --kv-disk-dir $disk --kv-disk-gb 1"
)
# shellcheck disable=SC2034
configs="pool-only host host+disk"
