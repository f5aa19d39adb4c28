//go:build !linux

package mptcp

import (
	"context"
	"fmt"
)

// SystemAddrs is the AddrSource of a network namespace; it is only
// implemented on Linux.
type SystemAddrs struct{}

// DialAddrs returns an error wrapping ErrUnsupported.
func DialAddrs() (*SystemAddrs, error) {
	return nil, fmt.Errorf("mptcp: address source: %w", ErrUnsupported)
}

// Close does nothing.
func (s *SystemAddrs) Close() error { return nil }

// Interfaces returns an error wrapping ErrUnsupported.
func (s *SystemAddrs) Interfaces() ([]Interface, error) {
	return nil, fmt.Errorf("mptcp: address source: %w", ErrUnsupported)
}

// AddrChanges returns an error wrapping ErrUnsupported.
func AddrChanges(ctx context.Context) (<-chan struct{}, error) {
	return nil, fmt.Errorf("mptcp: address changes: %w", ErrUnsupported)
}
