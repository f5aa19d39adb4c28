#!/usr/bin/env bash
# The whole test suite: formatting, vet, unit + root integration tests with
# the race detector, and a short run of every fuzz target. Vet, lint and
# tests cover both modules: the driver's (the root) and the e2e suites'
# (e2e/go.mod).
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZTIME=${FUZZTIME:-8s}
MODULES=(. e2e)

# step prints a step's title with the minutes and seconds since the start,
# so that a slow CI run shows where its time went.
step() { printf '== %s [%d:%02d]\n' "$*" $((SECONDS / 60)) $((SECONDS % 60)); }

step "gofmt"
unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
  echo "gofmt needed:"; echo "$unformatted"; exit 1
fi

step "licence headers"
# Every Go file carries hack/boilerplate.go.txt (after a build constraint
# at most); generated code gets it from hack/generate.sh.
unlicensed=$(for f in $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'); do
  head -n 16 "$f" | grep -qF '// Licensed under the Apache License, Version 2.0' || echo "$f"
done)
if [ -n "$unlicensed" ]; then
  echo "missing the licence header (hack/boilerplate.go.txt):"; echo "$unlicensed"; exit 1
fi

step "generated code is up to date"
bash hack/generate.sh
if ! git diff --quiet -- api deploy/crds charts/mpnbd/files/crds 2>/dev/null; then
  echo "hack/generate.sh changed generated files; commit them:"; git diff --stat -- api deploy/crds charts/mpnbd/files/crds; exit 1
fi

for m in "${MODULES[@]}"; do
  step "go vet ($m)"
  (cd "$m" && go vet ./...)
done

step "golangci-lint"
GOLANGCI_LINT=$(bash hack/golangci-lint.sh | sed -n 's/^GOLANGCI_LINT=//p')
[ -n "$GOLANGCI_LINT" ] || { echo "hack/golangci-lint.sh gave no path"; exit 1; }
for m in "${MODULES[@]}"; do
  echo "-- $m"
  (cd "$m" && "$GOLANGCI_LINT" run ./...)
done

if [ "$(id -u)" = 0 ]; then
  step "test API server (etcd + kube-apiserver, cached)"
  bash hack/test-apiserver.sh
  export MPNBD_APISERVER_REQUIRE=${MPNBD_APISERVER_REQUIRE:-1}
  step "packaging tools (helm, cached)"
  bash hack/tools.sh
  export MPNBD_DEPLOY_REQUIRE=${MPNBD_DEPLOY_REQUIRE:-1}
  step "cluster suite: Kubernetes binaries, the Dockerfile's base images, a Debian rootfs, CSI sidecars (cached)"
  KUBE_BINARIES="kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl" bash hack/kube-binaries.sh
  bash hack/image.sh --base-only
  bash hack/rootfs.sh
  bash hack/sidecars.sh
  # Kubernetes' storage suites for external drivers (the cluster suite's
  # kubeStorageScenario): e2e.test, ginkgo and agnhost, cached.
  bash hack/kube-e2e.sh
  export MPNBD_CLUSTER_REQUIRE=${MPNBD_CLUSTER_REQUIRE:-1}
  # make release's test (e2e/release): the arm64 image's runtime stage runs
  # under qemu-user-static, registered with binfmt_misc here.
  step "foreign architectures (binfmt_misc)"
  bash hack/binfmt.sh arm64
  export MPNBD_RELEASE_REQUIRE=${MPNBD_RELEASE_REQUIRE:-1}
  # The kernel transport's VM tests need a kernel whose nbd accepts MPTCP:
  # built from Debian's 6.1 source once (~20 minutes on 2 cores), cached.
  # MPNBD_VM_MPTCP_REQUIRE=0 skips the build and lets those tests skip.
  if [ "${MPNBD_VM_MPTCP_REQUIRE:-1}" = 1 ]; then
    step "VM kernel whose nbd accepts MPTCP (cached)"
    bash hack/vm-kernel-mptcp.sh
    export MPNBD_VM_MPTCP_REQUIRE=1
  fi
fi

[ "$(id -u)" = 0 ] || echo "note: not root; tests that need network namespaces will skip"
export MPNBD_VM_REQUIRE=${MPNBD_VM_REQUIRE:-$([ "$(id -u)" = 0 ] && echo 1 || echo 0)}
for m in "${MODULES[@]}"; do
  step "go test -race ($m)"
  (cd "$m" && go test -race -count=1 -timeout 40m ./...)
done

step "fuzz (${FUZZTIME} each)"
grep -l '^func Fuzz' $(git ls-files '*_test.go') | while read -r f; do
  # Run in the module that holds the package: e2e/... is the e2e module.
  m=.; pkg=./$(dirname "$f")
  case $f in e2e/*) m=e2e; pkg=./$(dirname "${f#e2e/}") ;; esac
  for fn in $(grep -o '^func Fuzz[A-Za-z0-9_]*' "$f" | cut -d' ' -f2); do
    echo "-- $m: $pkg $fn"
    fuzz() { (cd "$m" && go test -run '^$' -fuzz "^${fn}\$" -fuzztime "$FUZZTIME" "$pkg") >/tmp/fuzz.$$.log 2>&1; }
    if ! fuzz; then
      # Go's fuzzing coordinator can fail its own stop at the -fuzztime
      # deadline on a busy machine (golang/go#75804, fixed in Go 1.27):
      # a bare "context deadline exceeded" with no failing input written.
      # That, and only that, runs the target once more.
      if grep -q 'context deadline exceeded' /tmp/fuzz.$$.log && ! grep -q 'Failing input written to' /tmp/fuzz.$$.log; then
        echo "   the fuzzing engine's own deadline, no failing input: once more"
        fuzz || { cat /tmp/fuzz.$$.log; exit 1; }
      else
        cat /tmp/fuzz.$$.log; exit 1
      fi
    fi
  done
done
rm -f /tmp/fuzz.$$.log
echo "all tests passed [$((SECONDS / 60)):$(printf %02d $((SECONDS % 60)))]"
