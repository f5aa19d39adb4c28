#!/usr/bin/env bash
# Demo, in two parts. Needs root (network namespaces, mounts, FUSE).
#
# 1. Our NBD server and client over one connection, first plain TCP on
#    one 1 Gbit/s path, then MPTCP over four (seqread and seqwrite, 1 MiB
#    requests, 5 s each). Prints a table and writes out/demo.json and the
#    chart out/demo.svg. Extra arguments go to this benchmark (e.g.
#    --duration 10s).
# 2. The CSI driver end to end (bin/driverdemo): a real API server, the
#    storage agent in the storage node's namespace, the controller, and
#    the node plugin in the worker's namespace; through the CSI API a
#    volume is created, published, staged and mounted, a 256 MiB file is
#    written and read back across the four paths, the MPTCP subflows are
#    shown, and everything is torn down. Writes out/driverdemo.json.
#    DRIVERDEMO_ARGS passes flags to it (e.g. "--size 1GiB --volume-size
#    2GiB", or "--transport relay" on a kernel with nbd).
#    DRIVERDEMO_ARGS="--fio" then also measures fio through the block
#    device, ext4 and xfs against the raw NBD client (bin/nbdload) on the
#    same paths, one volume each, and prints the ratios (about 5 minutes;
#    --fio-seconds 10s per run, --volume-size 2GiB by default; the backing
#    files on /dev/shm). Alone, after a build: bin/driverdemo --fio.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "demo: needs root (network namespaces); try: sudo $0 $*" >&2
  exit 1
fi
go build -o bin/ ./cmd/nbd-server ./cmd/controller ./cmd/node
(cd e2e && go build -o ../bin/ ./cmd/nbdload ./cmd/bench ./cmd/driverdemo) # the e2e module
bin/bench --profile demo "$@"
echo
echo "=== The CSI driver: a volume over NBD on MPTCP, as Kubernetes would use it ==="
# shellcheck disable=SC2086 # DRIVERDEMO_ARGS is a list of flags
exec bin/driverdemo ${DRIVERDEMO_ARGS:-}
