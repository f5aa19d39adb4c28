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

package mptcp

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// GetInfo reads MPTCP_INFO (getsockopt(SOL_MPTCP, MPTCP_INFO)) from c,
// which must be a *net.TCPConn or wrap one via a NetConn method.
//
// The error wraps ErrNotMPTCP when c is not a TCP connection, is a plain
// TCP socket, or is an MPTCP socket that fell back to TCP (the kernel then
// forwards the option to the TCP subflow, which rejects it).
func GetInfo(c net.Conn) (Info, error) {
	tc := TCPConn(c)
	if tc == nil {
		return Info{}, fmt.Errorf("%w: %T is not a TCP connection", ErrNotMPTCP, c)
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return Info{}, fmt.Errorf("mptcp: %w", err)
	}
	var (
		buf  [InfoSize]byte
		n    uint32
		serr error
	)
	cerr := rc.Control(func(fd uintptr) {
		n, serr = getsockoptBytes(fd, SolMPTCP, OptMPTCPInfo, buf[:])
	})
	if cerr != nil {
		return Info{}, fmt.Errorf("mptcp: %w", cerr)
	}
	if serr != nil {
		if errors.Is(serr, unix.ENOPROTOOPT) || errors.Is(serr, unix.EOPNOTSUPP) {
			return Info{}, fmt.Errorf("%w: getsockopt(MPTCP_INFO): %w", ErrNotMPTCP, serr)
		}
		return Info{}, os.NewSyscallError("getsockopt(MPTCP_INFO)", serr)
	}
	info, err := DecodeInfo(buf[:min(int(n), len(buf))])
	if err != nil {
		return Info{}, err
	}
	if info.Fallback() {
		return info, fmt.Errorf("%w: kernel reports fallback to TCP", ErrNotMPTCP)
	}
	return info, nil
}

// getsockoptBytes calls getsockopt(2) with b as the option buffer and
// returns the length the kernel reported.
func getsockoptBytes(fd uintptr, level, opt int, b []byte) (uint32, error) {
	l := uint32(len(b))
	_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&b[0])), uintptr(unsafe.Pointer(&l)), 0)
	if e != 0 {
		return 0, e
	}
	return l, nil
}

// Available reports whether this kernel lets the process create MPTCP
// sockets in the current network namespace. The error wraps
// ErrUnsupported and says why not (e.g. net.mptcp.enabled=0).
func Available() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, unix.IPPROTO_MPTCP)
	if err == nil {
		unix.Close(fd)
		return nil
	}
	reason := err.Error()
	if b, rerr := os.ReadFile("/proc/sys/net/mptcp/enabled"); rerr == nil {
		reason = fmt.Sprintf("%v (net.mptcp.enabled=%s)", err, strings.TrimSpace(string(b)))
	}
	return fmt.Errorf("%w: cannot create an IPPROTO_MPTCP socket: %s", ErrUnsupported, reason)
}
