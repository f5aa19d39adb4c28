#!/usr/bin/env bash
# Builds the Kubernetes server binaries the tests need (kube-apiserver for
# the controller tests; later kubelet and friends for the cluster suite)
# from the Go module proxy, in a build module of their own (never the
# driver's go.mod), and caches them outside the repository:
#   ${MPNBD_KUBE_CACHE:-/var/cache/mpnbd/kube}/<version>/bin/
# Prints KUBE_BIN=<dir>. A warm cache makes this a no-op.
set -euo pipefail
source "$(dirname "$0")/lib/kube-module.sh"
VERSION=${KUBE_VERSION:-v1.34.4}
CACHE=${MPNBD_KUBE_CACHE:-/var/cache/mpnbd/kube}/$VERSION
BINS=${KUBE_BINARIES:-kube-apiserver}
mkdir -p "$CACHE/bin"
missing=()
for b in $BINS; do [ -x "$CACHE/bin/$b" ] || missing+=("$b"); done
if ((${#missing[@]} == 0)); then
  echo "KUBE_BIN=$CACHE/bin"
  exit 0
fi

exec 9>"$CACHE/.lock"
flock 9
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
gomod=$(kube_gomod "$VERSION")
{
  echo "module mpnbd.local/kubebuild"
  echo "go 1.26"
  echo "require k8s.io/kubernetes $VERSION"
  kube_replaces "$gomod" "$VERSION"
} > go.mod
{
  echo "//go:build tools"
  echo "package tools"
  echo "import ("
  for b in $BINS; do echo "  _ \"k8s.io/kubernetes/cmd/$b\""; done
  echo ")"
} > tools.go
go mod tidy >/dev/null
ldflags=$(kube_ldflags "$VERSION")
for b in "${missing[@]}"; do
  echo "building $b $VERSION (cold: several minutes)" >&2
  CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$CACHE/bin/$b.tmp" "k8s.io/kubernetes/cmd/$b"
  mv "$CACHE/bin/$b.tmp" "$CACHE/bin/$b"
done
echo "KUBE_BIN=$CACHE/bin"
