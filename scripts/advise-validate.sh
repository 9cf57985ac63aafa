#!/usr/bin/env bash
# Validate `cacheroute advise` against measured studies (docs/advise-validation.md): advise on
# the paper's whale ablation and 32B regimes (traces generated from the studies' generators) and
# on the bundled Mooncake traces, then run the studies it predicts (every policy at its
# defaults) into one database. Release build; about half an hour on a 2-core machine.
# Usage: bash scripts/advise-validate.sh [OUT_DIR]   (default /tmp/advise-validation)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/advise-validation}
mkdir -p "$out"
cargo build --release --locked
cr=./target/release/cacheroute
v=scripts/advise-validation

advise() { # name, then advise's arguments
  local name=$1
  shift
  echo "== advise $name"
  local start
  start=$(date +%s%N)
  set +e
  "$cr" advise "$@" --out "$out/$name.md" > "$out/$name.txt"
  local rc=$?
  set -e
  echo "   exit $rc, $(( ($(date +%s%N) - start) / 1000000 )) ms; $out/$name.md"
  sed -n '/^verdict/,$p' "$out/$name.txt"
}

"$cr" trace gen --config $v/ablation-8b-whales.workload.yaml --qps 250 --duration 600 -o "$out/ablation.jsonl"
advise ablation --trace "$out/ablation.jsonl" --engine llama-3.1-8b:h100:fp8:tp1 --destinations 30 --slo-p99-s 1.0
for k in 2048 128824; do
  "$cr" trace gen --config $v/regimes-32b-K$k.workload.yaml --qps 40 --duration 1800 -o "$out/regimes-K$k.jsonl"
  advise regimes-K$k --trace "$out/regimes-K$k.jsonl" --engine qwen2.5-32b:h100:fp8:tp1 --destinations 30 --slo-p99-s 3.5
done
advise mooncake-conversation --trace data/traces/mooncake_conversation_trace.jsonl \
  --engine llama-3.1-8b:h100:fp8:tp1 --destinations 8 --slo-metric ttft --slo-p99-s 8 --qps 16
advise mooncake-synthetic --trace data/traces/mooncake_synthetic_trace.jsonl \
  --engine llama-3.1-8b:h100:fp8:tp1 --destinations 8 --slo-metric ttft --slo-p99-s 4 --qps 12

# The studies: every policy at its defaults, each study's ladder and seeds, capacities located
# to 5% between ladder steps (`refine: 0.05`, as advise's knees; the Mooncake experiments get it
# in a copy, their trace path made absolute).
for s in $v/ablation-check.spec.yaml $v/regimes-check.spec.yaml \
  experiments/mooncake-conversation-8b.yaml experiments/mooncake-synthetic-8b.yaml; do
  echo "== study $s"
  if ! grep -q '^refine:' "$s"; then
    copy="$out/$(basename "$s" .yaml).refined.yaml"
    sed -e "s#  trace: ../data/#  trace: $PWD/data/#" -e 's/^\(ladder: .*\)$/\1\nrefine: 0.05/' "$s" > "$copy"
    s=$copy
  fi
  "$cr" run "$s" --db "$out/check.db" --out "$out/reports" --resume --quiet
done
echo "reports: $out/reports"
