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

package main

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// listenerMPTCP reports whether l's socket is really an MPTCP socket: the
// Go runtime silently falls back to plain TCP when the kernel refuses
// IPPROTO_MPTCP (e.g. net.mptcp.enabled=0).
func listenerMPTCP(l net.Listener) (bool, error) {
	tl, ok := l.(*net.TCPListener)
	if !ok {
		return false, nil
	}
	rc, err := tl.SyscallConn()
	if err != nil {
		return false, err
	}
	var proto int
	var serr error
	if err := rc.Control(func(fd uintptr) {
		proto, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PROTOCOL)
	}); err != nil {
		return false, err
	}
	if serr != nil {
		return false, fmt.Errorf("getsockopt(SO_PROTOCOL): %w", serr)
	}
	return proto == unix.IPPROTO_MPTCP, nil
}
