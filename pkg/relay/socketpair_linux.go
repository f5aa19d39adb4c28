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

package relay

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// NewSocketPair returns the two ends of an AF_UNIX stream socket pair made
// close-on-exec. kernelEnd is for the kernel (its descriptor goes in the
// NBD netlink SOCK_FD attribute; the caller closes it once the kernel holds
// its own reference); relayEnd is the relay's local connection.
func NewSocketPair() (kernelEnd *os.File, relayEnd net.Conn, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, os.NewSyscallError("socketpair", err)
	}
	for _, fd := range fds {
		setBuffers(fd)
	}
	kernelEnd = os.NewFile(uintptr(fds[0]), "nbd-socketpair-kernel")
	rf := os.NewFile(uintptr(fds[1]), "nbd-socketpair-relay")
	// FileConn duplicates the descriptor (close-on-exec) and registers it
	// with the runtime poller.
	relayEnd, err = net.FileConn(rf)
	rf.Close()
	if err != nil {
		kernelEnd.Close()
		return nil, nil, fmt.Errorf("relay: socket pair: %w", err)
	}
	return kernelEnd, relayEnd, nil
}

// socketBuffer is the send buffer asked for on both ends. The default
// (about 200 KiB) splits every 1 MiB frame into several wake-ups of the
// peer; a few MiB let a whole frame, or a batch of small ones, pass at
// once.
const socketBuffer = 4 << 20

// setBuffers raises the send buffer of fd, past net.core.wmem_max when
// the process may (CAP_NET_ADMIN), else as far as the limit allows.
// Failure only costs speed.
func setBuffers(fd int) {
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, socketBuffer) != nil {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, socketBuffer)
	}
}
