#!/usr/bin/env bash
# Decisions/s behind Envoy on this machine, one run: Envoy alone (round robin over the
# backends, started by `cacheroute peer` as a study starts it), Envoy + `cacheroute epp`
# (deploy/envoy/epp.yaml, policy cacheroute) and `cacheroute route`, each driven open loop by
# `cacheroute replay` at each offered rate, in front of the same three `cacheroute emulate`
# backends (tiny engine, 1000x time scale, one output token: the backends cost little).
#
#   bash benches/epp_speed.sh [SECS] [RATE...]      # defaults: 10 2000 5000
#
# Prints one row per target and rate: offered and achieved req/s, requests that failed, and
# end-to-end p50/p99 (ms). Then the EPP alone, driven closed loop over gRPC for SECS seconds
# by h2load (Debian's nghttp2-client; the row is skipped without it) with what Envoy sends per
# request: request headers, the whole body, response headers; its rate is the most decisions
# per second the EPP makes here without Envoy in the way. Everything (backends, Envoy with 2
# workers, the EPP, the load generator) shares this machine's cores. Env: BIN (default
# target/release/cacheroute, built first); ENVOY_EPP_YAML (default deploy/envoy/epp.yaml: the
# Envoy configuration in front of the EPP, its ports replaced).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
shift || true
RATES=${*:-2000 5000}
ENVOY=$(bash scripts/install-peers.sh envoy | awk '{print $3}')
if [ -z "${BIN:-}" ]; then
  cargo build --release --locked --bin cacheroute >&2
  BIN=target/release/cacheroute
fi
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  # `start` runs in a command substitution (a subshell): its processes are listed in a file.
  for p in "${PIDS[@]}" $(cat "$WORK/pids" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start NAME CMD…: run CMD in the background and wait for its `listening on URL` line.
start() {
  local name=$1
  shift
  "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  echo $! >>"$WORK/pids"
  for _ in $(seq 600); do
    if grep -q '^listening on ' "$WORK/$name.out" 2>/dev/null; then
      sed -n 's/^listening on //p' "$WORK/$name.out" | head -1
      return
    fi
    sleep 0.1
  done
  echo "error: $name did not start: $(tail -3 "$WORK/$name.err")" >&2
  exit 1
}

BACKENDS=()
for i in 0 1 2; do
  u=$(start "emulate$i" "$BIN" emulate --listen 127.0.0.1:0 --engine tiny:cpu:bf16:tp1 \
    --time-scale 1000 --model-name m)
  BACKENDS+=("$u")
done
flags=()
for b in "${BACKENDS[@]}"; do flags+=(--backend "$b"); done

EPP=$(start epp "$BIN" epp --listen 127.0.0.1:0 --policy cacheroute "${flags[@]}")
EPP_ADDR=${EPP#grpc://}
listen=$(port)
admin=$(port)
sed -e "s/port_value: 8081/port_value: $listen/" -e "s/port_value: 9901/port_value: $admin/" \
  -e "s/port_value: 9002/port_value: ${EPP##*:}/" "${ENVOY_EPP_YAML:-deploy/envoy/epp.yaml}" \
  >"$WORK/envoy-epp.yaml"
"$ENVOY" -c "$WORK/envoy-epp.yaml" --use-dynamic-base-id --concurrency 2 -l error \
  >"$WORK/envoy-epp.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$admin/ready" >/dev/null 2>&1 && break
  sleep 0.1
done
ENVOY_EPP="http://127.0.0.1:$listen"

workers=()
for b in "${BACKENDS[@]}"; do workers+=(--worker "$b"); done
ENVOY_ALONE=$(start envoy-alone "$BIN" peer --router envoy --policy round_robin "${workers[@]}" \
  --binary "$ENVOY" --dir "$WORK/envoy-alone")
ROUTE=$(start route "$BIN" route --listen 127.0.0.1:0 --policy cacheroute --workers 2 "${flags[@]}")

# 100k requests, 500 keys, 16-token prompts, one output token.
python3 - "$WORK/trace.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(100000):
        k = i % 500
        f.write(json.dumps({"timestamp": i, "key": f"k{k}", "input_length": 16,
                            "output_length": 1, "hash_ids": [k]}) + "\n")
PY

printf '| target | offered req/s | achieved req/s | failed | p50 ms | p99 ms |\n| --- | --- | --- | --- | --- | --- |\n'
for rate in $RATES; do
  for t in "envoy alone=$ENVOY_ALONE" "envoy + epp=$ENVOY_EPP" "route=$ROUTE"; do
    name=${t%%=*}
    url=${t#*=}
    "$BIN" replay --target "$url" --trace "$WORK/trace.jsonl" --qps "$rate" --duration "$SECS" \
      --block-tokens 16 --model m --json 2>/dev/null >"$WORK/r.json" || true
    python3 - "$WORK/r.json" "$name" "$rate" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"| {sys.argv[2]} | {sys.argv[3]} | (no result: {e}) | | | |")
    sys.exit()
failed = r["requests"] - r["ok"]
ms = lambda x: "-" if x is None else f"{x*1e3:.1f}"
print(f"| {sys.argv[2]} | {sys.argv[3]} | {r['achieved_qps']:.0f} | {failed} | {ms(r['e2e_p50_s'])} | {ms(r['e2e_p99_s'])} |")
PY
  done
done

# The EPP alone: one `Process` stream per request, as Envoy opens them, 2 connections (Envoy's
# 2 workers) with up to 64 streams each, for SECS seconds.
if command -v h2load >/dev/null; then
  python3 - "$WORK/process.bin" "${BACKENDS[0]#http://}" <<'PY'
import struct, sys
def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7f
        n >>= 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)
def field(tag, data):
    return varint(tag << 3 | 2) + varint(len(data)) + data
def flag(tag):
    return varint(tag << 3) + b"\x01"
def headers(pairs):
    return field(1, b"".join(field(1, field(1, k.encode()) + field(3, v.encode())) for k, v in pairs))
def frame(msg):
    return b"\0" + struct.pack(">I", len(msg)) + msg
body = b'{"model":"m","prompt":"the shared system prompt of tenant 7 and a question","max_tokens":1}'
req = [(":authority", "127.0.0.1:8081"), (":path", "/v1/completions"), (":method", "POST"),
       (":scheme", "http"), ("content-type", "application/json"),
       ("content-length", str(len(body))), ("user-agent", "bench"), ("x-forwarded-proto", "http"),
       ("x-request-id", "6b1c9a3e-8d4f-4a51-9e0b-2f7c1d3a5b60")]
resp = [(":status", "200"), ("content-type", "application/json"),
        ("x-gateway-destination-endpoint-served", sys.argv[2])]
with open(sys.argv[1], "wb") as f:
    f.write(frame(field(2, headers(req))) + frame(field(4, field(1, body) + flag(2)))
            + frame(field(3, headers(resp))))
PY
  h2load -D "$SECS" -c 2 -m 64 -d "$WORK/process.bin" -H 'content-type: application/grpc' \
    -H 'te: trailers' "http://$EPP_ADDR/envoy.service.ext_proc.v3.ExternalProcessor/Process" \
    >"$WORK/h2load.txt" 2>&1 || true
  python3 - "$WORK/h2load.txt" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
rate = re.search(r"finished in [\d.]+s, ([\d.]+) req/s", t)
req = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded", t)
mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", t)
if not (rate and req):
    print(f"| epp alone (h2load, gRPC) | max | (no result: {t.strip().splitlines()[-1:]}) | | | |")
else:
    print(f"| epp alone (h2load, gRPC) | max | {float(rate.group(1)):.0f} | {int(req.group(1)) - int(req.group(3))} | mean {mean.group(1) if mean else '-'} | |")
PY
fi
