package nbdnl

import (
	"os"

	"golang.org/x/sys/unix"
)

// socketProtocol returns the SO_PROTOCOL of the socket behind f.
func socketProtocol(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var (
		proto int
		serr  error
	)
	if err := rc.Control(func(fd uintptr) {
		proto, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PROTOCOL)
	}); err != nil {
		return 0, err
	}
	return proto, serr
}
