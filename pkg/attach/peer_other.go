//go:build !linux

package attach

import (
	"errors"
	"net"
)

// PeerCred is only implemented on Linux.
func PeerCred(net.Conn) (uid uint32, pid int32, err error) {
	return 0, 0, errors.New("attach: peer credentials are Linux only")
}
