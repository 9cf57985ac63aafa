#!/usr/bin/env bash
# Run every study of the paper in simulation into results.db and write reports/ (release build).
# Rerunnable: a study already complete in the database is reported again; an interrupted one
# resumes. Usage: bash scripts/run-studies.sh [study ...]   (default: all of experiments/)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked
db=${DB:-results.db}
studies=("$@")
if [ ${#studies[@]} -eq 0 ]; then
  studies=(flagship-70b-fp8 flagship-70b-fp16 second-distribution ablation-8b-whales regimes-32b
           fleet-size drift-staleness burstiness burstiness-bootstrap calibration)
fi
for s in "${studies[@]}"; do
  echo "== $s"
  start=$(date +%s)
  ./target/release/cacheroute run "experiments/$s.yaml" --db "$db" --resume --quiet
  echo "   ($(( $(date +%s) - start )) s)"
done
./target/release/cacheroute compare flagship-70b-fp8 flagship-70b-fp16 --db "$db" --out reports/compare-fp8-fp16.md > /dev/null
echo "comparison: reports/compare-fp8-fp16.md"
