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
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// setUserTimeout sets TCP_USER_TIMEOUT on tc.
func setUserTimeout(tc *net.TCPConn, d time.Duration) error {
	rc, err := tc.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(d/time.Millisecond))
	}); err != nil {
		return err
	}
	return os.NewSyscallError("setsockopt(TCP_USER_TIMEOUT)", serr)
}

// lastAckRecv reads tcpi_last_ack_recv of a plain TCP socket.
func lastAckRecv(tc *net.TCPConn) (time.Duration, error) {
	rc, err := tc.SyscallConn()
	if err != nil {
		return 0, err
	}
	var (
		info *unix.TCPInfo
		serr error
	)
	if err := rc.Control(func(fd uintptr) { info, serr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil {
		return 0, err
	}
	if serr != nil {
		return 0, os.NewSyscallError("getsockopt(TCP_INFO)", serr)
	}
	if info.State != tcpEstablished {
		return 0, ErrPeerUnknown
	}
	return time.Duration(info.Last_ack_recv) * time.Millisecond, nil
}
