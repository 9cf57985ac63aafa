#!/usr/bin/env bash
# The EPP's budgets under a hostile client, one case at a time (examples/epp_hostile.rs),
# against the EPP binary BIN (default: target/release/cacheroute, built first), each case on a
# fresh EPP with default settings but --max-connections 50 for `connections`. Prints the
# client's line and the EPP's resident memory (VmRSS before, VmHWM: its peak) and whether it
# logged a panic. docs/epp.md, "Budgets".
#
#   bash scripts/epp-hostile.sh [CASE...]     # default: partial connections headers body
#
# Env: BIN (the EPP binary to try; default target/$DIR/cacheroute, built first), PROFILE
# (release, or dev for a quicker build: DIR is then debug).
set -euo pipefail
cd "$(dirname "$0")/.."
CASES=${*:-partial connections headers body}
PROFILE=${PROFILE:-release}
DIR=$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")
if [ -z "${BIN:-}" ]; then
  cargo build --profile "$PROFILE" --locked --bin cacheroute >&2
  BIN=target/$DIR/cacheroute
fi
cargo build --profile "$PROFILE" --locked --example epp_hostile >&2
CLIENT=target/$DIR/examples/epp_hostile
WORK=$(mktemp -d)
trap 'kill $(cat "$WORK"/pids 2>/dev/null) 2>/dev/null || true; rm -rf "$WORK"' EXIT
# A backend that accepts and says nothing: the EPP only needs an address to name.
python3 -c 'import socket,time
s=socket.socket(); s.bind(("127.0.0.1",0)); s.listen(64); print(s.getsockname()[1], flush=True)
time.sleep(3600)' >"$WORK/backend" &
echo $! >>"$WORK/pids"
while [ ! -s "$WORK/backend" ]; do sleep 0.1; done
BACKEND="http://127.0.0.1:$(cat "$WORK/backend")"
for c in $CASES; do
  extra=()
  [ "$c" = connections ] && extra=(--max-connections 50)
  "$BIN" epp --listen 127.0.0.1:0 --policy chwbl --backend "$BACKEND" "${extra[@]}" \
    >"$WORK/out" 2>"$WORK/err" &
  pid=$!
  echo $pid >>"$WORK/pids"
  while ! grep -q "listening on" "$WORK/out" 2>/dev/null; do sleep 0.1; done
  addr=$(sed -n 's/^listening on grpc:\/\///p' "$WORK/out")
  rss0=$(awk '/VmRSS/{print $2}' /proc/$pid/status)
  line=$("$CLIENT" "$addr" "$c" 2>&1 || true)
  hwm=$(awk '/VmHWM/{print $2}' /proc/$pid/status 2>/dev/null || echo gone)
  panics=$(grep -c "panicked" "$WORK/err" || true)
  echo "$line | EPP RSS $((rss0 / 1024)) MB before, peak $((${hwm:-0} / 1024)) MB; panics logged: $panics"
  kill $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
done
