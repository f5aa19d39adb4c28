//go:build !linux

package mptcp

import (
	"fmt"
	"net"
	"runtime"
)

// GetInfo is only implemented on Linux; elsewhere it returns an error
// wrapping ErrUnsupported.
func GetInfo(c net.Conn) (Info, error) {
	return Info{}, fmt.Errorf("%w (GOOS=%s)", ErrUnsupported, runtime.GOOS)
}

// Available reports whether MPTCP sockets can be created; on this
// platform they cannot, so the error wraps ErrUnsupported.
func Available() error {
	return fmt.Errorf("%w (GOOS=%s)", ErrUnsupported, runtime.GOOS)
}
