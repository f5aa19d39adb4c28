#!/usr/bin/env bash
# Builds the packaging tools the tests use from the Go module proxy, in a
# throwaway build module of their own (never the driver's go.mod), and
# caches them outside the repository:
#   ${MPNBD_TOOLS_CACHE:-/var/cache/mpnbd/tools}/helm-<version>/helm
# Prints HELM=<path>. A warm cache makes this a no-op. kustomize needs no
# build: `kubectl kustomize` is used.
set -euo pipefail
HELM_VERSION=${HELM_VERSION:-v3.21.4}
CACHE=${MPNBD_TOOLS_CACHE:-/var/cache/mpnbd/tools}
dir=$CACHE/helm-$HELM_VERSION
helm=$dir/helm
if [ -x "$helm" ]; then
  echo "HELM=$helm"
  exit 0
fi

mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9
if [ -x "$helm" ]; then # built by a concurrent run meanwhile
  echo "HELM=$helm"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
{
  echo "module mpnbd.local/toolbuild"
  echo "go 1.26"
  echo "require helm.sh/helm/v3 $HELM_VERSION"
} > go.mod
{
  echo "//go:build tools"
  echo "package tools"
  echo "import _ \"helm.sh/helm/v3/cmd/helm\""
} > tools.go
go mod tidy >/dev/null 2>&1 || GOFLAGS=-mod=mod go mod tidy >&2
echo "building helm $HELM_VERSION (cold: a few minutes)" >&2
CGO_ENABLED=0 go build -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
  -o "$helm.tmp" helm.sh/helm/v3/cmd/helm
mv "$helm.tmp" "$helm"
echo "HELM=$helm"
