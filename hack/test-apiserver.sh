#!/usr/bin/env bash
# Makes sure the binaries controller-runtime's envtest needs are present
# (etcd from Debian's etcd-server package, kube-apiserver built by
# hack/kube-binaries.sh) and prints KUBEBUILDER_ASSETS=<dir>, a directory
# holding both (symlinks next to the cached kube-apiserver).
set -euo pipefail
cd "$(dirname "$0")/.."

etcd=$(command -v etcd || true)
if [ -z "$etcd" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "etcd is missing and installing it needs root (apt-get install etcd-server)" >&2
    exit 1
  fi
  echo "installing etcd-server" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
  etcd=$(command -v etcd)
fi

kube_bin=$(KUBE_BINARIES=kube-apiserver hack/kube-binaries.sh | sed -n 's/^KUBE_BIN=//p' | tail -n1)
[ -n "$kube_bin" ] && [ -x "$kube_bin/kube-apiserver" ] || { echo "kube-apiserver not available" >&2; exit 1; }

assets=$(dirname "$kube_bin")/envtest
mkdir -p "$assets"
ln -sfn "$kube_bin/kube-apiserver" "$assets/kube-apiserver"
ln -sfn "$etcd" "$assets/etcd"
echo "KUBEBUILDER_ASSETS=$assets"
