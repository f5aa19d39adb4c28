#!/usr/bin/env bash
# Lets this machine run programs of another architecture (arm64 on amd64)
# under qemu-user-static: the emulated steps of a foreign image build
# (debootstrap's second stage, the Dockerfile's apt-get) need it.
#
#   hack/binfmt.sh [ARCH...]      default: arm64
#
# Debian's qemu-user-static ships binfmt_misc entries in /usr/lib/binfmt.d
# but registers them only where systemd-binfmt runs; this writes them into
# the kernel itself. The entries carry the F flag (the interpreter is opened
# now, so it works inside a build's chroot and mount namespace too).
set -euo pipefail
(($#)) || set -- arm64
[ "$(id -u)" = 0 ] || { echo "hack/binfmt.sh: needs root" >&2; exit 1; }
mnt=/proc/sys/fs/binfmt_misc
[ -e "$mnt/register" ] || mount -t binfmt_misc binfmt_misc "$mnt"
for arch in "$@"; do
  case $arch in
    arm64) q=aarch64 ;;
    amd64) q=x86_64 ;;
    *) q=$arch ;;
  esac
  [ "$(uname -m)" != "$q" ] || continue # this machine's own
  if [ -e "$mnt/qemu-$q" ]; then
    grep -qx enabled "$mnt/qemu-$q" || echo 1 >"$mnt/qemu-$q"
    continue
  fi
  conf=/usr/lib/binfmt.d/qemu-$q.conf
  [ -r "$conf" ] || { echo "hack/binfmt.sh: no $conf: install qemu-user-static" >&2; exit 1; }
  grep -v '^#' "$conf" | grep . >"$mnt/register"
  echo "registered qemu-$q with binfmt_misc" >&2
done
