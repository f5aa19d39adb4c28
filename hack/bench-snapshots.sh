#!/usr/bin/env bash
# Snapshot and restore of a 1 GiB volume holding 512 MiB of data, through
# the storage agent and a real API server: by reflink on XFS and by copy on
# ext4, side by side in one run (pkg/agent TestSnapshotRestoreTimes).
# Needs root (loop-mounted filesystems).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "bench-snapshots: needs root (loop mounts); try: sudo $0" >&2
  exit 1
fi
bash hack/test-apiserver.sh >/dev/null
MPNBD_MEASURE=1 go test -count=1 -v -timeout 20m -run '^TestSnapshotRestoreTimes$' ./pkg/agent |
  grep -E 'snapshot ready in|same run:|^(ok|FAIL|---)' 
