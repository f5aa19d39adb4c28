//go:build !linux

package snapshot

import (
	"context"
	"errors"
	"io/fs"
	"os"
)

func clone(context.Context, *os.File, *os.File, *options, *writeHold, *Result) error {
	return errors.ErrUnsupported
}

func allocated(f *os.File) (int64, error) {
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}

func renameNoReplace(oldpath, newpath string) error {
	if _, err := os.Lstat(newpath); err == nil {
		return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: fs.ErrExist}
	}
	return os.Rename(oldpath, newpath)
}
