//go:build !linux

package relay

import (
	"net"
	"os"
)

// NewSocketPair is only implemented on Linux.
func NewSocketPair() (kernelEnd *os.File, relayEnd net.Conn, err error) {
	return nil, nil, ErrUnsupported
}
