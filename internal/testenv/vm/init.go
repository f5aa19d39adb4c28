// Copyright 2026 The mpnbd Authors.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

package vm

import "strings"

// initTemplate is the guest's /init, run by busybox sh as PID 1. @NONCE@
// is replaced by a per-run random string so that payload output cannot be
// mistaken for the markers.
const initTemplate = `#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TMPDIR=/tmp TERM=dumb LANG=C.UTF-8
export MPNBD_IN_VM=1

off() {
	# Let the serial port transmit everything before powering off.
	stty -F /dev/console -ixon >/dev/null 2>&1
	sync
	poweroff -f
	echo o >/proc/sysrq-trigger
	sleep 10
}
fail() {
	echo "MPNBD-VM-SETUP-ERROR-@NONCE@: $*"
	off
}

mount -t proc proc /proc || fail "mount /proc"
mount -t sysfs sysfs /sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "mount /dev"
mkdir -p /dev/pts /dev/shm /dev/mqueue
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t mqueue mqueue /dev/mqueue 2>/dev/null
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
ln -sf /proc/self/fd /dev/fd
ln -sf /proc/self/fd/0 /dev/stdin
ln -sf /proc/self/fd/1 /dev/stdout
ln -sf /proc/self/fd/2 /dev/stderr
hostname -F /etc/hostname
ip link set lo up || fail "ip link set lo up"

while read -r mod args; do
	[ -n "$mod" ] || continue
	insmod "$mod" $args || fail "insmod ${mod##*/} $args"
done </etc/mpnbd-vm/modules
. /etc/mpnbd-vm/net

. /etc/mpnbd-vm/env
cd /
echo "MPNBD-VM-START-@NONCE@"
sh /etc/mpnbd-vm/payload </dev/null
code=$?
echo
echo "MPNBD-VM-EXIT-@NONCE@=$code"
off
`

func initScript(nonce string) string {
	return strings.ReplaceAll(initTemplate, "@NONCE@", nonce)
}
