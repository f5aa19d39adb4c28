// Copyright 2026 The mpnbd Authors.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

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
