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
