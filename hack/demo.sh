#!/usr/bin/env bash
# Demo: our NBD server and client over one connection, first plain TCP on
# one 1 Gbit/s path, then MPTCP over four (seqread and seqwrite, 1 MiB
# requests, 5 s each). Prints a table and writes out/demo.json and the
# chart out/demo.svg. Needs root (network namespaces). Extra arguments go
# to the benchmark (e.g. --duration 10s).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "demo: needs root (network namespaces); try: sudo $0 $*" >&2
  exit 1
fi
go build -o bin/ ./cmd/nbd-server ./e2e/cmd/nbdload ./e2e/cmd/bench
exec bin/bench --profile demo "$@"
