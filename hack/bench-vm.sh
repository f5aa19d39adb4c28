#!/usr/bin/env bash
# Prints the nbd transports side by side in the e2e VM booted with the
# kernel whose nbd accepts MPTCP (hack/vm-kernel-mptcp.sh, built here if
# not cached: ~20 minutes cold): kernel, relay, multiconn and tcp over the
# same four veth paths, the same sequential 1 MiB O_DIRECT write and read,
# throughput and guest CPU seconds per GB, with ratios to tcp. Nothing is
# asserted. Needs root (network namespaces, qemu).
#
#   MPNBD_BENCH_MB   amount written and read per transport (default 256)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench-vm: needs root" >&2; exit 1; }
bash hack/vm-kernel-mptcp.sh >/dev/null
log=$(mktemp)
trap 'rm -f "$log"' EXIT
MPNBD_VM_BENCH=1 MPNBD_VM_REQUIRE=1 MPNBD_VM_MPTCP_REQUIRE=1 \
  go test -count=1 -timeout 30m -run '^TestBenchTransportsMPTCPKernelInVM$' -v ./e2e/nodeattach/ >"$log" 2>&1 ||
  { cat "$log"; exit 1; }
sed -n '/BENCH-TABLE-BEGIN/,/BENCH-TABLE-END/p' "$log" | sed '/BENCH-TABLE-/d; s/^ \{1,8\}//'
