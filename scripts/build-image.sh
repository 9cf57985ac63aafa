#!/usr/bin/env bash
# Builds the cacheroute image (deploy/Containerfile) with podman from a binary built on this host:
# the binary, the shared libraries `ldd` names for it and the dynamic loader, in a `scratch` image
# that runs as UID 65532. No registry is needed (nothing is pulled).
#
#   cargo build --locked --release && bash scripts/build-image.sh   # target/release/cacheroute
#   bash scripts/build-image.sh target/debug/cacheroute                   # any other build
#
# Environment: IMAGE, the tag (default localhost/cacheroute:latest); PODMAN, the podman command
# with any global flags (default `podman`; on a machine like the test VM:
# PODMAN="podman --storage-driver vfs --runtime runc --cgroup-manager cgroupfs").
# Prints `built IMAGE (N bytes)` on its last line. docs/deploy.md has the rest.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
binary="${1:-$repo/target/release/cacheroute}"
image="${IMAGE:-localhost/cacheroute:latest}"
read -r -a podman <<<"${PODMAN:-podman}"

fail() { echo "error: build-image: $*" >&2; exit 1; }
[ -f "$binary" ] && [ -x "$binary" ] ||
  fail "$binary is not an executable file; build it first (cargo build --locked --release) or name one: scripts/build-image.sh target/debug/cacheroute"
command -v "${podman[0]}" >/dev/null ||
  fail "${podman[0]} not found; install it (apt-get install --no-install-recommends podman runc)"

# The build context: the binary (hard-linked when it can be: a debug build is ~170 MB) and rootfs/
# with the libraries at the paths ldd names. Under target/ so a hard link usually works.
mkdir -p "$repo/target"
ctx="$(mktemp -d "$repo/target/image-context.XXXXXX")"
trap 'rm -rf "$ctx"' EXIT
ln "$binary" "$ctx/cacheroute" 2>/dev/null || cp "$binary" "$ctx/cacheroute"
mkdir -p "$ctx/rootfs/etc"

# `ldd` lines: `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)`, the loader as
# `/lib64/ld-linux-x86-64.so.2 (0x…)`, the kernel's `linux-vdso.so.1 (0x…)` (no file).
if ! deps="$(ldd "$binary" 2>&1)"; then
  case "$deps" in
    *"not a dynamic executable"* | *"statically linked"*) deps="" ;;
    *) fail "ldd $binary failed: $deps" ;;
  esac
fi
if grep -q "not found" <<<"$deps"; then
  fail "$binary needs libraries this host lacks: $(grep 'not found' <<<"$deps" | tr -s ' \t' ' ' | paste -sd ';')"
fi
libs=0
while read -r path; do
  [ -n "$path" ] || continue
  mkdir -p "$ctx/rootfs$(dirname "$path")"
  cp -L "$path" "$ctx/rootfs$path"
  libs=$((libs + 1))
done < <(sed -n -E 's#^[[:space:]]*([^[:space:]]+ => )?(/[^[:space:]]+) \(0x[0-9a-f]+\)$#\2#p' <<<"$deps")

# The user the image runs as, by name for tools that show one; and /etc/hosts before DNS.
echo "cacheroute:x:65532:65532:cacheroute:/nonexistent:/sbin/nologin" >"$ctx/rootfs/etc/passwd"
echo "cacheroute:x:65532:" >"$ctx/rootfs/etc/group"
echo "hosts: files dns" >"$ctx/rootfs/etc/nsswitch.conf"

echo "building $image from $binary ($libs libraries from ldd)" >&2
"${podman[@]}" build --layers=false --file "$repo/deploy/Containerfile" --tag "$image" "$ctx" >&2
size="$("${podman[@]}" image inspect --format '{{.Size}}' "$image")"
echo "built $image ($size bytes)"
