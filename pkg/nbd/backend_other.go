//go:build !linux

package nbd

import "os"

func fdatasync(f *os.File) error { return f.Sync() }

func punchHole(f *os.File, off, length int64) error { return writeZeroes(f, off, length) }

func zeroRange(f *os.File, off, length int64) error { return writeZeroes(f, off, length) }
