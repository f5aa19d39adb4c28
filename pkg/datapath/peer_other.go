//go:build !linux

package datapath

import (
	"errors"
	"net"
)

// checkRoot cannot tell the peer here: a handover needs Linux anyway.
func checkRoot(*net.UnixConn) error {
	return errors.New("datapath: handover needs Linux (peer credentials)")
}
