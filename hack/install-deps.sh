#!/usr/bin/env bash
# Installs what the tests, benchmarks and demo need on a fresh Debian 12 machine.
set -euo pipefail
pkgs=(iproute2 nbd-server nbd-client nbdkit libnbd-bin qemu-utils qemu-system-x86 busybox-static fio mptcpd mptcpize iperf3 e2fsprogs xfsprogs util-linux etcd-server
  containerd runc containernetworking-plugins iptables nftables conntrack debootstrap openssl buildah
  linux-source-6.1 flex bison libelf-dev bc libssl-dev prometheus qemu-user-static gnupg socat)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The prometheus package is here for promtool: its server stays off.
if [ -d /run/systemd/system ]; then
  systemctl disable --now prometheus.service >/dev/null 2>&1 || true
fi
cd "$(dirname "$0")/.."
go mod download
(cd e2e && go mod download) # the e2e suites' module
# Packaging tests (e2e/deploy): helm built from the Go module proxy and
# cached (cold: ~1.5 min on 2 cores), and kubectl for `kubectl kustomize`
# and the dry runs (built next to kube-apiserver when none is installed).
bash hack/tools.sh
if ! command -v kubectl >/dev/null; then
  KUBE_BINARIES=kubectl bash hack/kube-binaries.sh
fi
