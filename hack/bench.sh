#!/usr/bin/env bash
# Side-by-side benchmark of NBD servers (ours, nbdkit, nbd-server) and
# clients (fio, nbdload) over the multi-path test topology; see
# `go -C e2e doc ./cmd/bench`. Arguments go to the benchmark, e.g.
#   hack/bench.sh --quick
#   hack/bench.sh --repeat 1 --servers ours,nbdkit --networks mptcp4
# Prints the table; the JSON report goes to out/bench.json. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "bench: needs root (network namespaces); try: sudo $0 $*" >&2
  exit 1
fi
go build -o bin/ ./cmd/nbd-server
(cd e2e && go build -o ../bin/ ./cmd/nbdload ./cmd/bench) # the e2e module
exec bin/bench "$@"
