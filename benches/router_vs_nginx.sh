#!/usr/bin/env bash
# Router overhead against nginx on this machine, same backend and same load, in one run.
#
#   bash benches/router_vs_nginx.sh [RATE] [SECS] [POLICY]    # defaults: 2000 10 sticky
#
# Env: ROUNDS (interleaved rounds per phase, default 20), ROUTER_WORKERS (default 2), RUNS
# (default 1: how many times to start everything afresh and measure), RECORD (a file each
# run's figures are appended to; the summary over all runs in it is printed after each run;
# default a temporary file, so the summary covers this invocation's runs), PEERS (the external
# routers measured in the same run, each `router:policy`; default `smg:consistent_hashing
# vllm-router:consistent_hash sglang-router:round_robin envoy:ring_hash`, empty for none; each
# installed by scripts/install-peers.sh and started by `cacheroute peer` exactly as a study
# starts it), RECORD_ALL (like RECORD, every target's added p50/p99 and max req/s; the
# per-target summary over its runs, mean and 95% CI, is printed after each run), BIN (the
# router binary; default target/release/cacheroute, built first), CLIENT (the load client;
# default the bench's own, built first): set both to compare two builds with one client.
#
# Installs nginx if missing (Debian package, idempotent), builds the release binary and the
# load client, starts one nginx as the trivial backend (a fixed JSON body on two ports = two
# destinations), one nginx as the peer proxy (`hash $http_x_cacheroute_key consistent`,
# keepalive upstreams) and `cacheroute route` with the same two destinations, then prints a
# table: p50/p99 at RATE req/s open loop (added = minus the direct backend's) and the maximum
# req/s closed loop. Both proxies get 2 workers; everything shares this machine's cores.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-2000}
SECS=${2:-10}
POLICY=${3:-sticky}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}

if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  echo "installing nginx (apt-get install -y nginx)…" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y nginx >/dev/null || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y nginx >/dev/null; }
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

PEERS=${PEERS-smg:consistent_hashing vllm-router:consistent_hash sglang-router:round_robin envoy:ring_hash}
if [ -n "$PEERS" ]; then
  names=$(for p in $PEERS; do echo "${p%%:*}"; done | sort -u | tr '\n' ' ')
  # shellcheck disable=SC2086
  bash scripts/install-peers.sh $names >/dev/null
fi

if [ -z "${BIN:-}" ]; then
  cargo build --release --bin cacheroute >&2
  BIN=$CARGO_TARGET_DIR/release/cacheroute
fi
if [ -z "${CLIENT:-}" ]; then
  cargo bench --bench router_vs_nginx --no-run >&2 2>/dev/null || true
  CLIENT=$(ls -t "$CARGO_TARGET_DIR"/release/deps/router_vs_nginx-* | grep -v '\.d$' | head -1)
fi

WORK=$(mktemp -d)
RECORD=${RECORD:-$WORK/runs.tsv}
RECORD_ALL=${RECORD_ALL:-$WORK/all.tsv}
PIDS=()
stop_all() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
cleanup() { stop_all; rm -rf "$WORK"; }
trap cleanup EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

run_once() {
B1=$(port); B2=$(port); NP=$(port); RP=$(port)
rm -rf "$WORK/backend" "$WORK/proxy"

mkdir -p "$WORK/backend/logs" "$WORK/proxy/logs"
cat > "$WORK/backend/nginx.conf" <<CONF
worker_processes 1;
error_log stderr error;
pid $WORK/backend/nginx.pid;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:$B1; listen 127.0.0.1:$B2;
    location /health { return 200 '{}'; }
    # SMG routes only to workers that list the request's model.
    location = /v1/models { default_type application/json; return 200 '{"object":"list","data":[{"id":"m","object":"model","owned_by":"bench"}]}'; }
    location / { default_type application/json; return 200 '{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"stop"}]}'; }
  }
}
CONF
cat > "$WORK/proxy/nginx.conf" <<CONF
worker_processes 2;
error_log stderr error;
pid $WORK/proxy/nginx.pid;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 1000000;
  upstream engines {
    hash \$http_x_cacheroute_key consistent;
    server 127.0.0.1:$B1;
    server 127.0.0.1:$B2;
    keepalive 256;
  }
  server {
    listen 127.0.0.1:$NP;
    location / {
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
CONF
"$NGINX" -p "$WORK/backend" -c "$WORK/backend/nginx.conf" -g 'daemon off;' & PIDS+=($!)
"$NGINX" -p "$WORK/proxy" -c "$WORK/proxy/nginx.conf" -g 'daemon off;' & PIDS+=($!)
TOKIO_WORKER_THREADS=2 "$BIN" route --workers "${ROUTER_WORKERS:-2}" --listen 127.0.0.1:$RP \
  --backend http://127.0.0.1:$B1 --backend http://127.0.0.1:$B2 --policy "$POLICY" > "$WORK/router.out" 2>/dev/null & PIDS+=($!)
for _ in $(seq 50); do grep -q listening "$WORK/router.out" 2>/dev/null && break; sleep 0.1; done
TARGETS=()
for p in $PEERS; do
  out="$WORK/peer-${p%%:*}-${p#*:}.out"
  "$BIN" peer --router "${p%%:*}" --policy "${p#*:}" \
    --worker http://127.0.0.1:$B1 --worker http://127.0.0.1:$B2 > "$out" 2>"$out.err" & PIDS+=($!)
  for _ in $(seq 600); do grep -q listening "$out" 2>/dev/null && break; sleep 0.1; done
  url=$(sed -n 's/^listening on //p' "$out")
  [ -n "$url" ] || { echo "error: $p did not start: $(tail -1 "$out.err")" >&2; exit 1; }
  sed -n 2p "$out" >&2
  TARGETS+=(--target "$p=$url")
done
sleep 0.5

echo "router_vs_nginx: ${RATE} req/s open loop for ${SECS}s, then closed loop; policy ${POLICY}; $(nproc) cores" >&2
"$CLIENT" --direct http://127.0.0.1:$B1 --nginx http://127.0.0.1:$NP --router http://127.0.0.1:$RP \
  "${TARGETS[@]}" --rate "$RATE" --secs "$SECS" --rounds "${ROUNDS:-20}" --record "$RECORD" \
  --record-all "$RECORD_ALL"
stop_all
}

for run in $(seq "${RUNS:-1}"); do
  [ "${RUNS:-1}" -gt 1 ] && echo "run $run of ${RUNS}" >&2
  run_once
done
