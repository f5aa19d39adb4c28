#!/usr/bin/env bash
# Prints the block-device transports side by side in the e2e VM booted
# with the kernel whose nbd accepts MPTCP (hack/vm-kernel-mptcp.sh, built
# here if not cached: ~20 minutes cold): tcp, multiconn, relay, kernel,
# ublk and fuse (the last two where that kernel has them) over the same
# four veth paths, each against our raw NBD client (no block device) on
# the same paths in the same run. fio in the guest, all O_DIRECT at queue
# depth 32:
#   - 1 MiB sequential write, then a sequential read that verifies every
#     block (crc32c and offset), so a transport that corrupts data fails
#     instead of posting a number;
#   - 4 KiB random write, then random read, time based, over the same
#     region;
#   - the same four passes on a file of ext4, and of xfs, made on the
#     device (xfs needs mkfs.xfs on the host: xfsprogs).
# For each: fio's MB/s (IOPS for 4 KiB) with its ratio to the raw client,
# and guest CPU seconds per GB (/proc/stat of the whole guest). Nothing is
# asserted but the data. Needs root (network namespaces, qemu) and fio on
# the host (copied into the VM). About 20 minutes under TCG on two idle
# cores.
#
#   MPNBD_BENCH_MB        MiB written and read sequentially per transport,
#                         also the region of the random passes (default 256)
#   MPNBD_BENCH_SECONDS   length of each random pass (default 20)
#   MPNBD_BENCH_TRANSPORTS  comma-separated transports to measure beside
#                         tcp (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench-vm: needs root" >&2; exit 1; }
bash hack/vm-kernel-mptcp.sh >/dev/null
log=$(mktemp)
trap 'rm -f "$log"' EXIT
(cd e2e && MPNBD_VM_BENCH=1 MPNBD_VM_REQUIRE=1 MPNBD_VM_MPTCP_REQUIRE=1 \
  go test -count=1 -timeout 90m -run '^TestBenchTransportsMPTCPKernelInVM$' -v ./nodeattach/) >"$log" 2>&1 ||
  { cat "$log"; exit 1; }
sed -n '/BENCH-TABLE-BEGIN/,/BENCH-TABLE-END/p' "$log" | sed '/BENCH-TABLE-/d; s/^ \{1,8\}//'
