#!/usr/bin/env bash
# Builds golangci-lint (a pinned version) from the Go module proxy, with
# its own go.mod (never the driver's), cached outside the repository:
#   ${MPNBD_TOOLS_CACHE:-/var/cache/mpnbd/tools}/golangci-lint-<version>/golangci-lint
# Prints GOLANGCI_LINT=<path>. A warm cache makes this a no-op.
set -euo pipefail
VERSION=${GOLANGCI_LINT_VERSION:-v2.15.0}
CACHE=${MPNBD_TOOLS_CACHE:-/var/cache/mpnbd/tools}
dir=$CACHE/golangci-lint-$VERSION
bin=$dir/golangci-lint
if [ -x "$bin" ]; then
  echo "GOLANGCI_LINT=$bin"
  exit 0
fi
mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9
if [ -x "$bin" ]; then
  echo "GOLANGCI_LINT=$bin"
  exit 0
fi
echo "building golangci-lint $VERSION (cold: a few minutes)" >&2
# go install MODULE@VERSION builds with the tool's own go.mod.
GOBIN="$dir/.gobin" CGO_ENABLED=0 go install -trimpath \
  -ldflags "-s -w -X main.version=${VERSION#v}" \
  "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$VERSION"
mv "$dir/.gobin/golangci-lint" "$bin"
rm -rf "$dir/.gobin"
echo "GOLANGCI_LINT=$bin"
