//go:build !linux

package mptcp

import (
	"fmt"
	"net/netip"
)

func probePath(local, remote netip.Addr, rate float64) (float64, error) {
	return 0, fmt.Errorf("mptcp: path probe: %w", ErrUnsupported)
}
