//go:build !linux

package mptcp

import "fmt"

func dialPM() (*PM, error) {
	return nil, fmt.Errorf("mptcp: path manager: %w", ErrUnsupported)
}
