#!/usr/bin/env bash
# One-shot plan construction against the plain-Python reference, alternated run by run so
# that both see the same machine state (docs/planner.md, "Measured").
#
#   cargo build --release
#   bash scripts/plan-vs-python.sh [RUNS] [BINARY...]
#
# Each run starts a fresh `cacheroute plan` (every key of data/paper-rates.csv admitted:
# R = 30, q_cap = 6, W = 4294) for each BINARY (default target/release/cacheroute), then
# `scripts/plan_heapq.py --repeat 1` on the same input, and records each one's build time.
# Prints per binary the median and range of build_ms, and the ratio Python / plan per run:
# its median and in how many runs it is at least 100.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-21}
shift || true
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(target/release/cacheroute)
args=(--rates data/paper-rates.csv --destinations 30 --q-cap 6 --warm-slots 4294)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for _ in $(seq "$runs"); do
  for i in "${!bins[@]}"; do
    "${bins[$i]}" plan "${args[@]}" | sed -n 's/^built in \([0-9.]*\) ms$/\1/p' >>"$tmp/plan$i"
  done
  python3 scripts/plan_heapq.py data/paper-rates.csv --destinations 30 --q-cap 6 \
    --warm-slots 4294 --repeat 1 | sed -n 's/.*best \([0-9.]*\) ms.*/\1/p' >>"$tmp/python"
done
python3 - "$tmp" "${bins[@]}" <<'PY'
import statistics, sys
tmp, bins = sys.argv[1], sys.argv[2:]
py = [float(x) for x in open(f"{tmp}/python")]
print(f"python: median {statistics.median(py):.1f} ms ({min(py):.1f}-{max(py):.1f}), {len(py)} runs")
for i, b in enumerate(bins):
    ms = [float(x) for x in open(f"{tmp}/plan{i}")]
    r = [p / m for p, m in zip(py, ms)]
    print(f"{b}: build_ms median {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}); "
          f"python/plan median {statistics.median(r):.0f}x ({min(r):.0f}-{max(r):.0f}x), "
          f">= 100x in {sum(x >= 100 for x in r)} of {len(r)} runs")
PY
