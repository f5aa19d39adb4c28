//go:build !linux

package mptcp

import (
	"fmt"
	"net"
	"runtime"
)

// GetSubflows is only implemented on Linux; elsewhere it returns an error
// wrapping ErrUnsupported.
func GetSubflows(c net.Conn) ([]SubflowInfo, error) {
	return nil, fmt.Errorf("%w (GOOS=%s)", ErrUnsupported, runtime.GOOS)
}
