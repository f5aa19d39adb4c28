//go:build !linux

package mptcp

// RaiseStaleLossCount needs Linux.
func RaiseStaleLossCount(int) (int, error) { return 0, ErrUnsupported }
