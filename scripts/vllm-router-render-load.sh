#!/usr/bin/env bash
# How many of the vLLM router's decisions are made without token ids (`missing_tokens`) at a
# load: N emulators at a time scale, the vLLM router's cache_aware in front of them (started
# by `cacheroute peer`, as a study starts it), the flagship-shaped generator replayed
# open-loop through it, then the router's own counters. docs/peers.md ("Why the vLLM router
# routed without token ids under load") has the figures and what they mean.
#
#   bash scripts/vllm-router-render-load.sh QPS DURATION_S EMULATORS TIME_SCALE [CACHEROUTE]
#   bash scripts/vllm-router-render-load.sh 32 10 2 4 target/debug/cacheroute
#
# QPS is the real request rate (the emulators run TIME_SCALE× faster, as in a study whose
# schedule is compressed by `local.time_scale`). Needs `bash scripts/install-peers.sh
# vllm-router`. Prints the replayer's summary and the counters
# `vllm_router_prefix_routing_decisions_total` and `vllm_router_kv_routing_inputs_total`.
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
qps=$1 duration=$2 n=$3 scale=$4
bin=${5:-target/release/cacheroute}
[ -x "$bin" ] || { echo "error: $bin is not an executable; build it (cargo build --release) or pass its path" >&2; exit 2; }
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
url_in() { # the first http://… in file $1, waiting up to 30 s for it
  for _ in $(seq 300); do
    if u=$(grep -o 'http://[0-9.:]*' "$1" 2>/dev/null | head -1) && [ -n "$u" ]; then echo "$u"; return; fi
    sleep 0.1
  done
  echo "error: nothing listening after 30 s; its output: $(cat "$1")" >&2
  exit 1
}
workers=()
for i in $(seq "$n"); do
  "$bin" emulate --engine llama-3.1-8b:h100:fp8:tp1 --listen 127.0.0.1:0 --time-scale "$scale" \
    > "$dir/emulator-$i.log" 2>&1 &
  pids+=($!)
done
for i in $(seq "$n"); do workers+=(--worker "$(url_in "$dir/emulator-$i.log")"); done
"$bin" peer --router vllm-router --policy cache_aware "${workers[@]}" --dir "$dir/router" \
  > "$dir/peer.log" 2>&1 &
pids+=($!)
for _ in $(seq 300); do grep -q 'listening on' "$dir/peer.log" && break; sleep 0.2; done
router=$(grep -o 'listening on http://[0-9.:]*' "$dir/peer.log" | awk '{print $3}')
[ -n "$router" ] || { echo "error: the vLLM router did not start: $(cat "$dir/peer.log")" >&2; exit 1; }
metrics=$(grep -o -- '--prometheus-port [0-9]*' "$dir/peer.log" | awk '{print $2}')
# The study's own generator block, dedented.
awk '/^  generator:/ {on = 1; next} /^[^ ]/ {on = 0} on' \
  "$(dirname "$0")/../experiments/peers-flagship-shaped.yaml" | sed 's/^    //' > "$dir/generator.yaml"
"$bin" replay --target "$router" --workload "$dir/generator.yaml" --qps "$qps" \
  --duration "$duration" --key-header x-session-id --seed 1
curl -s "127.0.0.1:$metrics/metrics" | grep -E '^vllm_router_(prefix_routing_decisions|kv_routing_inputs)'
