#!/usr/bin/env bash
# Builds the runtime root file system of the driver's image for the local
# cluster suite, equivalent to the Dockerfile's runtime stage (Debian
# bookworm, minbase, with e2fsprogs, xfsprogs and util-linux for
# mount-utils), with debootstrap, and caches it as a tar:
#   ${MPNBD_ROOTFS_CACHE:-/var/cache/mpnbd/rootfs}/bookworm-<key>.tar
# Prints ROOTFS=<tar>. A warm cache makes this a no-op.
set -euo pipefail
SUITE=bookworm
PKGS=e2fsprogs,xfsprogs,util-linux,mount,ca-certificates
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${MPNBD_ROOTFS_CACHE:-/var/cache/mpnbd/rootfs}
key=$(printf '%s %s' "$SUITE" "$PKGS" | sha256sum | cut -c1-12)
out=$CACHE/$SUITE-$key.tar
mkdir -p "$CACHE"
if [ -s "$out" ]; then
  echo "ROOTFS=$out"
  exit 0
fi
exec 9>"$CACHE/.lock"
flock 9
if [ -s "$out" ]; then
  echo "ROOTFS=$out"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "debootstrap $SUITE (cold: a few minutes)" >&2
debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$work/root" "$MIRROR" >"$work/log" 2>&1 || {
  tail -20 "$work/log" >&2
  exit 1
}
# What an image does not need.
rm -rf "$work/root/var/cache/apt/archives"/*.deb "$work/root/var/lib/apt/lists"/* "$work/root/usr/share/doc" "$work/root/usr/share/man"
tar --numeric-owner -C "$work/root" -cf "$out.tmp" .
mv "$out.tmp" "$out"
echo "ROOTFS=$out"
