//go:build !linux

package mptcp

import "fmt"

// SocketDiag reads the TCP sockets of a network namespace (Linux only).
type SocketDiag struct{}

// DialSocketDiag fails: socket diagnostics are Linux only.
func DialSocketDiag() (*SocketDiag, error) {
	return nil, fmt.Errorf("mptcp: socket diagnostics: %w", ErrUnsupported)
}

// Close does nothing.
func (d *SocketDiag) Close() error { return nil }

// Established fails: socket diagnostics are Linux only.
func (d *SocketDiag) Established() ([]TCPSocket, error) {
	return nil, fmt.Errorf("mptcp: socket diagnostics: %w", ErrUnsupported)
}
