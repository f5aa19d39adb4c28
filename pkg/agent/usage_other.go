//go:build !linux

package agent

import (
	"errors"
	"io/fs"
)

// fsSpace is only implemented on Linux.
func fsSpace(dir string) (capacity, free int64, err error) {
	return 0, 0, errors.New("agent: filesystem space is only measured on linux")
}

// allocated counts the whole file where allocation is not known.
func allocated(fi fs.FileInfo) int64 { return fi.Size() }
