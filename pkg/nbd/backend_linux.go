package nbd

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

func fdatasync(f *os.File) error { return unix.Fdatasync(int(f.Fd())) }

// punchHole deallocates a range; reads of it return zeroes afterwards.
func punchHole(f *os.File, off, length int64) error {
	err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, length)
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENODEV) {
		// Filesystems and devices without hole punching still get zeroes.
		return zeroRange(f, off, length)
	}
	return err
}

// zeroRange zeroes a range and keeps it allocated.
func zeroRange(f *os.File, off, length int64) error {
	err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, length)
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENODEV) {
		return writeZeroes(f, off, length)
	}
	return err
}
