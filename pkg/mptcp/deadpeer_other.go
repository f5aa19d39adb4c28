//go:build !linux

package mptcp

import (
	"fmt"
	"net"
	"runtime"
	"time"
)

func setUserTimeout(*net.TCPConn, time.Duration) error {
	return fmt.Errorf("%w (GOOS=%s)", ErrUnsupported, runtime.GOOS)
}

func lastAckRecv(*net.TCPConn) (time.Duration, error) {
	return 0, fmt.Errorf("%w (GOOS=%s)", ErrUnsupported, runtime.GOOS)
}
