//go:build !linux

package bench

import (
	"context"
	"errors"
	"runtime"
)

var errUnsupported = errors.New("bench: network namespaces need Linux (GOOS=" + runtime.GOOS + ")")

// Run is only supported on Linux.
func Run(ctx context.Context, o Options) (*Report, error) { return &Report{}, errUnsupported }

// EnsureTmpfs is only supported on Linux.
func EnsureTmpfs(dir string) (string, func(), error) { return "", nil, errUnsupported }

// IsTmpfs is only supported on Linux.
func IsTmpfs(dir string) (bool, error) { return false, errUnsupported }
