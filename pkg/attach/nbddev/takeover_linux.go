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

package nbddev

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// A RECONFIGURE hands the kernel sockets for the device's dead slots. The
// kernel takes as many as it has dead slots and drops the rest without an
// error, so a process that re-adopts a healthy device, or a reconnect that
// races with another, would keep connections nobody uses. The kernel sets
// each socket it takes to send with the device's request timeout, which is
// how the attacher tells the two apart (the kernel-socket transports always
// have a request timeout).

// tookSocket reports whether the kernel took c in the last RECONFIGURE.
func tookSocket(c net.Conn) bool {
	tv, ok := sockTimeval(c, unix.SO_SNDTIMEO)
	return ok && (tv.Sec != 0 || tv.Usec != 0)
}

func sockTimeval(c net.Conn, opt int) (unix.Timeval, bool) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return unix.Timeval{}, false
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return unix.Timeval{}, false
	}
	var tv *unix.Timeval
	var gerr error
	if err := raw.Control(func(fd uintptr) {
		tv, gerr = unix.GetsockoptTimeval(int(fd), unix.SOL_SOCKET, opt)
	}); err != nil || gerr != nil {
		return unix.Timeval{}, false
	}
	return *tv, true
}

// stillConnected reports whether the kernel still uses c: the kernel shuts
// a dead slot's socket down, which takes it out of the established state.
func stillConnected(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	est := false
	if err := raw.Control(func(fd uintptr) {
		if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			est = info.State == unix.BPF_TCP_ESTABLISHED
		}
	}); err != nil {
		return false // closed
	}
	return est
}

// sortTaken splits the connections dialed for a RECONFIGURE into those the
// kernel took and those it dropped, and keeps of the earlier ones those
// the kernel still uses, never more handles than the device has
// connections.
func sortTaken(fresh, old []net.Conn, slots int) (keep, closing []net.Conn) {
	var taken []net.Conn
	for _, c := range fresh {
		if tookSocket(c) {
			taken = append(taken, c)
		} else {
			closing = append(closing, c)
		}
	}
	live := old
	if len(taken) > 0 {
		live = nil
		for _, c := range old {
			if stillConnected(c) {
				live = append(live, c)
			} else {
				closing = append(closing, c)
			}
		}
	}
	for len(live)+len(taken) > slots && len(live) > 0 {
		closing = append(closing, live[0])
		live = live[1:]
	}
	return append(live, taken...), closing
}
