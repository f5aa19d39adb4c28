//go:build !linux

package agent

import (
	"log/slog"
	"syscall"
)

// freeBindControl does nothing where there is no IP_FREEBIND.
func freeBindControl(*slog.Logger) func(network, address string, c syscall.RawConn) error {
	return nil
}
