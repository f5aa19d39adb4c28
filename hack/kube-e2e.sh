#!/usr/bin/env bash
# Builds what running Kubernetes' storage e2e suites (External.Storage)
# against the driver takes, from the Go module proxy at the pinned
# Kubernetes version, in a build module of its own (never the driver's
# go.mod), and caches it outside the repository:
#   ${MPNBD_KUBE_CACHE:-/var/cache/mpnbd/kube}/<version>/e2e/
#     e2e.test  Kubernetes' test/e2e/storage/external suites and nothing else
#               of test/e2e (its main: hack/kube-e2e/e2e_test.go, build tag
#               kube_e2e, which keeps it out of the driver's module);
#     ginkgo    the Ginkgo CLI at the version kubernetes' go.mod requires
#               (runs e2e.test in parallel: ginkgo -p ... e2e.test -- flags);
#     agnhost   test/images/agnhost, static, for the agnhost image.
# Prints E2E_TEST=<path> GINKGO=<path> AGNHOST=<path>. A warm cache makes
# this a no-op; e2e.test is rebuilt when hack/kube-e2e/ changes.
#
# Running the suites against a cluster with the driver installed (the
# subPath and block-provisioning specs run kubectl exec: give its path):
#   $GINKGO -p --focus='External.Storage' --timeout=2h $E2E_TEST -- \
#     -kubeconfig=<admin kubeconfig> -kubectl-path=<kubectl> \
#     -repo-root=<this repository> \
#     -storage.testdriver=e2e/cluster/testdata/testdriver.yaml
# e2e.test -list-tests (with -storage.testdriver) lists the specs without
# a cluster; so does -ginkgo.dry-run.
#
# Built on 2 cores: cold (nothing in the cache directory; modules downloaded
# and the Go build cache holding Kubernetes packages from hack/kube-binaries.sh)
# 57 s;
# warm 0.01 s. An empty Go build cache (not measured) takes longer.
# -list-tests with testdriver.yaml: 313 External.Storage specs (100 without
# [Feature:], [Serial], [Disruptive] or [Slow]).
#
# The images the storage suites run (k8s.io/kubernetes
# test/utils/image/manifest.go at v1.34.4) must be on the node, since the
# cluster suite pulls nothing: e2e/cluster E2EImages builds them from
# local files (agnhost from here, busybox from Debian's busybox-static):
#   registry.k8s.io/e2e-test-images/busybox:1.37.0-1  the default test image
#       (e2epod.GetDefaultTestImage: writer/reader pods, volume clients,
#       subPath, volume mode, expansion, multi-volume, provisioning checks)
#   registry.k8s.io/e2e-test-images/agnhost:2.56  subPath's containers
#       (e2epod.NewAgnhostContainer)
#   registry.k8s.io/e2e-test-images/nginx:1.14-4  "should allow exec of
#       files on the volume" (volumes suite: runs /bin/sh -ec, so a busybox
#       image under that name serves)
#   registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7  multi-volume
#       "concurrently access the single volume" pods (runs the same shell
#       commands as busybox pods: a busybox image under that name serves)
#   registry.k8s.io/pause:3.10.1  the kubelet's default sandbox image; the
#       cluster suite's containerd names its own (sandbox_image), so the
#       storage specs never name it themselves.
# Not needed with the driver's capabilities: volume/nfs:1.4, volume/iscsi
# (in-tree volume servers), sig-storage/nfs-provisioner, httpd (statefulset
# fixtures): no External.Storage spec runs them.
set -euo pipefail
source "$(dirname "$0")/lib/kube-module.sh"
VERSION=${KUBE_VERSION:-v1.34.4}
CACHE=${MPNBD_KUBE_CACHE:-/var/cache/mpnbd/kube}/$VERSION/e2e
root=$(cd "$(dirname "$0")/.." && pwd)
src=$root/hack/kube-e2e

# The e2e.test's key: its sources (the version keys the directory).
key=$(cat "$src"/*.go | sha256sum | cut -d' ' -f1)
warm() {
  [ -x "$CACHE/ginkgo" ] && [ -x "$CACHE/agnhost" ] && [ -x "$CACHE/e2e.test" ] &&
    [ "$(cat "$CACHE/e2e.test.key" 2>/dev/null)" = "$key" ]
}
report() {
  echo "E2E_TEST=$CACHE/e2e.test"
  echo "GINKGO=$CACHE/ginkgo"
  echo "AGNHOST=$CACHE/agnhost"
}
if warm; then
  report
  exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if warm; then
  report
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
gomod=$(kube_gomod "$VERSION")
ginkgo_version=$(awk '$1 == "github.com/onsi/ginkgo/v2" {print $2; exit}' "$gomod")
[ -n "$ginkgo_version" ] || { echo "k8s.io/kubernetes@$VERSION requires no github.com/onsi/ginkgo/v2" >&2; exit 1; }
{
  echo "module mpnbd.local/kubee2e"
  echo "go 1.26"
  echo "require ("
  echo "  k8s.io/kubernetes $VERSION"
  echo "  github.com/onsi/ginkgo/v2 $ginkgo_version"
  echo ")"
  kube_replaces "$gomod" "$VERSION"
} > go.mod
# The programs built from the module graph, kept by go mod tidy.
cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "github.com/onsi/ginkgo/v2/ginkgo"
	_ "k8s.io/kubernetes/test/images/agnhost"
)
GO
mkdir suite
cp "$src"/*.go suite/
go mod tidy >/dev/null
# MVS may not raise ginkgo above kubernetes' own requirement: the CLI must
# match the library e2e.test links.
got=$(go list -m -f '{{.Version}}' github.com/onsi/ginkgo/v2)
[ "$got" = "$ginkgo_version" ] || { echo "ginkgo resolved to $got, kubernetes requires $ginkgo_version" >&2; exit 1; }

ldflags=$(kube_ldflags "$VERSION")
if [ ! -x "$CACHE/ginkgo" ]; then
  echo "building ginkgo $ginkgo_version" >&2
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$CACHE/ginkgo.tmp" github.com/onsi/ginkgo/v2/ginkgo
  mv "$CACHE/ginkgo.tmp" "$CACHE/ginkgo"
fi
if [ ! -x "$CACHE/agnhost" ]; then
  echo "building agnhost $(cat "$(go list -m -f '{{.Dir}}' k8s.io/kubernetes)/test/images/agnhost/VERSION") ($VERSION)" >&2
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$CACHE/agnhost.tmp" k8s.io/kubernetes/test/images/agnhost
  mv "$CACHE/agnhost.tmp" "$CACHE/agnhost"
fi
if [ ! -x "$CACHE/e2e.test" ] || [ "$(cat "$CACHE/e2e.test.key" 2>/dev/null)" != "$key" ]; then
  echo "building e2e.test (storage/external) $VERSION (cold: several minutes)" >&2
  CGO_ENABLED=0 go test -c -tags kube_e2e -trimpath -ldflags "$ldflags" -o "$CACHE/e2e.test.tmp" ./suite
  mv "$CACHE/e2e.test.tmp" "$CACHE/e2e.test"
  echo "$key" > "$CACHE/e2e.test.key"
fi
report
