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

package snapshot

import (
	"errors"
	"io/fs"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Space is what a file uses on disk.
type Space struct {
	// Allocated is the bytes of the file's blocks (st_blocks*512), the
	// shared ones included.
	Allocated int64
	// Shared is the bytes of the file's extents that the filesystem shares
	// with another file (a reflink: a snapshot, its source or a clone).
	// Overwriting them allocates new blocks (copy on write); deleting the
	// file frees none of them while the other file keeps them.
	Shared int64
}

// The FS_IOC_FIEMAP ioctl (linux/fiemap.h), which maps a file's logical
// ranges to extents on disk and flags the shared ones.
const (
	fsIocFiemap        = 0xC020660B // _IOWR('f', 11, struct fiemap)
	fiemapExtentLast   = 0x1        // the file's last extent
	fiemapExtentShared = 0x2000     // the extent is shared with another file
	// fiemapBatch is how many extents one ioctl call maps.
	fiemapBatch = 256
)

// fiemap is struct fiemap followed by room for fiemapBatch extents, as the
// kernel reads and fills it.
type fiemap struct {
	start         uint64 // first logical byte to map
	length        uint64 // bytes to map from start
	flags         uint32 // FIEMAP_FLAG_*
	mappedExtents uint32 // extents filled in (out)
	extentCount   uint32 // room in extents (in)
	_             uint32
	extents       [fiemapBatch]fiemapExtent
}

// fiemapExtent is struct fiemap_extent (56 bytes).
type fiemapExtent struct {
	logical uint64 // byte offset in the file
	_       uint64 // byte offset on the device
	length  uint64 // bytes
	_       [2]uint64
	flags   uint32 // FIEMAP_EXTENT_*
	_       [3]uint32
}

// Usage reports the space the file at path uses: its allocated bytes and,
// where the filesystem tells (FIEMAP), how many of them it shares with
// other files, as the extents on disk stand (data not yet written back
// over a shared extent still counts as shared). A filesystem that cannot
// map extents reports no sharing.
func Usage(path string) (Space, error) {
	f, err := os.Open(path)
	if err != nil {
		return Space{}, err
	}
	defer f.Close()
	shared, err := sharedBytes(f)
	if err != nil {
		return Space{}, err
	}
	alloc, err := allocated(f)
	if err != nil {
		return Space{}, err
	}
	return Space{Allocated: alloc, Shared: shared}, nil
}

// sharedBytes sums the lengths of f's extents flagged shared, mapping the
// file fiemapBatch extents at a time.
func sharedBytes(f *os.File) (int64, error) {
	m := new(fiemap)
	var shared int64
	// next is the first byte not yet counted: a range that starts before
	// it (an extent the previous call returned too) counts only past it.
	var next uint64
	for {
		start := next
		// No FIEMAP_FLAG_SYNC: the agent measures every file at each
		// heartbeat and must not force their writeback. Data not yet
		// written back over a shared extent still maps to it, so Shared
		// errs high until then: the reserve it sizes errs safe.
		*m = fiemap{start: start, length: ^uint64(0) - next, extentCount: fiemapBatch}
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fsIocFiemap, uintptr(unsafe.Pointer(m)))
		if errno != 0 {
			if errors.Is(errno, unix.ENOTTY) || errors.Is(errno, unix.EOPNOTSUPP) || errors.Is(errno, unix.EINVAL) {
				return 0, nil
			}
			return 0, &fs.PathError{Op: "fiemap", Path: f.Name(), Err: errno}
		}
		n := min(m.mappedExtents, fiemapBatch)
		if n == 0 {
			return shared, nil
		}
		last := false
		for _, e := range m.extents[:n] {
			end := e.logical + e.length
			if e.flags&fiemapExtentShared != 0 && end > next {
				shared += int64(end - max(e.logical, next))
			}
			next = max(next, end)
			last = last || e.flags&fiemapExtentLast != 0
		}
		if last || next == ^uint64(0) || next <= start {
			// The end of the file, or a mapping that does not move on.
			return shared, nil
		}
	}
}
