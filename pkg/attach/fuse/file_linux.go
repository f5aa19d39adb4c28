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

package fuse

import (
	"errors"
	"log/slog"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// blockIO is the part of *nbd.Client the file needs.
type blockIO interface {
	ReadAt(p []byte, off int64) (int, error)
	WriteAt(p []byte, off int64) (int, error)
	Flush() error
	WriteZeroes(off, length int64, noHole bool) error
}

// exportFile is the regular file whose bytes are the export's. The
// methods answer the FUSE requests about it, with the errno to reply.
type exportFile struct {
	bio       blockIO
	size      atomic.Uint64
	readOnly  bool
	canZero   bool // the server accepts NBD_CMD_WRITE_ZEROES
	openFlags uint32
	mtime     time.Time
	log       *slog.Logger

	// lastErr is the last transport error (connection lost), for Health.
	lastErr atomic.Pointer[error]
}

func (f *exportFile) attrTime() uint64     { return uint64(f.mtime.Unix()) }
func (f *exportFile) attrTimeNsec() uint32 { return uint32(f.mtime.Nanosecond()) }

func (f *exportFile) attr() attr {
	mode := uint32(0o600)
	if f.readOnly {
		mode = 0o400
	}
	size := f.size.Load()
	return attr{
		Ino:      fileNode,
		Size:     size,
		Blocks:   (size + 511) / 512,
		Time:     f.attrTime(),
		TimeNsec: f.attrTimeNsec(),
		Mode:     unix.S_IFREG | mode,
		Nlink:    1,
		Blksize:  4096,
	}
}

// setattr accepts everything but a size change: the export's size is the
// server's to decide.
func (f *exportFile) setattr(hasSize bool, size uint64) syscall.Errno {
	if hasSize && size != f.size.Load() {
		return syscall.EPERM
	}
	return 0
}

func (f *exportFile) open(flags uint32) (uint32, syscall.Errno) {
	if f.readOnly && flags&unix.O_ACCMODE != unix.O_RDONLY {
		return 0, syscall.EROFS
	}
	return f.openFlags, 0
}

// read fills dest from off on; it returns how much the file had.
func (f *exportFile) read(dest []byte, off uint64) (int, syscall.Errno) {
	size := f.size.Load()
	if off > 1<<63-1 {
		return 0, syscall.EINVAL
	}
	if off >= size {
		return 0, 0
	}
	n := min(uint64(len(dest)), size-off)
	if _, err := f.bio.ReadAt(dest[:n], int64(off)); err != nil {
		return 0, f.errno("read", err)
	}
	return int(n), 0
}

func (f *exportFile) write(data []byte, off uint64) (uint32, syscall.Errno) {
	if f.readOnly {
		return 0, syscall.EROFS
	}
	size := f.size.Load()
	if off > 1<<63-1 {
		return 0, syscall.EINVAL
	}
	if off >= size {
		return 0, syscall.ENOSPC
	}
	// A write running past the end is cut short at the end.
	n := min(uint64(len(data)), size-off)
	if _, err := f.bio.WriteAt(data[:n], int64(off)); err != nil {
		return 0, f.errno("write", err)
	}
	return uint32(n), 0
}

func (f *exportFile) fsync() syscall.Errno {
	if f.readOnly {
		return 0
	}
	if err := f.bio.Flush(); err != nil {
		return f.errno("flush", err)
	}
	return 0
}

// allocate maps fallocate(2) to the NBD commands. Both punching a hole and
// zeroing a range must read back as zeroes afterwards, which only
// NBD_CMD_WRITE_ZEROES promises (the content of a trimmed range is
// unspecified by the protocol): punch hole lets the server deallocate,
// zero range (what the loop driver uses for REQ_NOUNMAP) does not. Plain
// allocation inside the file is a no-op; the file cannot grow.
func (f *exportFile) allocate(off, length uint64, mode uint32) syscall.Errno {
	if f.readOnly {
		return syscall.EROFS
	}
	size := f.size.Load()
	end := off + length
	if end < off {
		return syscall.EINVAL
	}
	switch mode &^ unix.FALLOC_FL_KEEP_SIZE {
	case 0:
		if end > size && mode&unix.FALLOC_FL_KEEP_SIZE == 0 {
			return syscall.EOPNOTSUPP
		}
		return 0
	case unix.FALLOC_FL_PUNCH_HOLE, unix.FALLOC_FL_ZERO_RANGE:
	default:
		return syscall.EOPNOTSUPP
	}
	if !f.canZero {
		return syscall.EOPNOTSUPP
	}
	if off >= size {
		return 0
	}
	end = min(end, size)
	noHole := mode&unix.FALLOC_FL_ZERO_RANGE != 0
	if err := f.bio.WriteZeroes(int64(off), int64(end-off), noHole); err != nil {
		return f.errno("write-zeroes", err)
	}
	return 0
}

// errno turns a client error into the errno the kernel passes on, and
// remembers transport failures.
func (f *exportFile) errno(op string, err error) syscall.Errno {
	var ne *nbd.Error
	switch {
	case errors.As(err, &ne):
		switch ne.Errno {
		case nbd.EPERM:
			return syscall.EPERM
		case nbd.ENOMEM:
			return syscall.ENOMEM
		case nbd.EINVAL:
			return syscall.EINVAL
		case nbd.ENOSPC:
			return syscall.ENOSPC
		case nbd.EOVERFLOW:
			return syscall.EOVERFLOW
		case nbd.ENOTSUP:
			return syscall.EOPNOTSUPP
		}
		return syscall.EIO
	case errors.Is(err, nbd.ErrUnaligned):
		return syscall.EINVAL
	}
	if f.lastErr.Swap(&err) == nil {
		f.log.Error("fuse: the NBD session failed a request (the storage node away past deadConnTimeout, or the session ended)", "op", op, "error", err)
	}
	return syscall.EIO
}
