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

package nbd

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// withFd runs fn on f's descriptor while the file is kept open, so a
// concurrent Close cannot hand the number to another file underneath us.
func withFd(f *os.File, fn func(fd int) error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var opErr error
	if err := rc.Control(func(fd uintptr) { opErr = fn(int(fd)) }); err != nil {
		return err
	}
	return opErr
}

func fdatasync(f *os.File) error { return withFd(f, unix.Fdatasync) }

// punchHole deallocates a range; reads of it return zeroes afterwards.
func punchHole(f *os.File, off, length int64) error {
	err := withFd(f, func(fd int) error {
		return unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, length)
	})
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENODEV) {
		// Filesystems and devices without hole punching still get zeroes.
		return zeroRange(f, off, length)
	}
	return err
}

// zeroRange zeroes a range and keeps it allocated.
func zeroRange(f *os.File, off, length int64) error {
	err := withFd(f, func(fd int) error {
		return unix.Fallocate(fd, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, length)
	})
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENODEV) {
		return writeZeroes(f, off, length)
	}
	return err
}
