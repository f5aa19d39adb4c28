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
	"fmt"
	"io"
	"os"
	"sync"
)

// Backend stores the bytes of one export. Implementations must allow
// concurrent calls: the server issues requests of one export from many
// goroutines and connections at once.
type Backend interface {
	io.ReaderAt
	io.WriterAt
	// Size is the export size in bytes.
	Size() int64
	// Sync makes every completed write durable.
	Sync() error
	// Trim discards a range; later reads return zeroes.
	Trim(off, length int64) error
	// Zero writes zeroes to a range; with noHole the range stays allocated.
	Zero(off, length int64, noHole bool) error
	// Resize changes the size (growing reads as zeroes).
	Resize(size int64) error
	Close() error
}

// MemBackend is an in-memory backend for tests and demos.
type MemBackend struct {
	mu   sync.RWMutex
	data []byte
}

// NewMemBackend returns a zeroed in-memory backend of size bytes.
func NewMemBackend(size int64) *MemBackend {
	return &MemBackend{data: make([]byte, size)}
}

func (m *MemBackend) ReadAt(p []byte, off int64) (int, error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if off < 0 || off > int64(len(m.data)) {
		return 0, io.EOF
	}
	n := copy(p, m.data[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (m *MemBackend) WriteAt(p []byte, off int64) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off < 0 || off+int64(len(p)) > int64(len(m.data)) {
		return 0, fmt.Errorf("write at %d+%d beyond %d: %w", off, len(p), len(m.data), ErrOutOfRange)
	}
	return copy(m.data[off:], p), nil
}

func (m *MemBackend) Size() int64 {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return int64(len(m.data))
}

func (m *MemBackend) Sync() error { return nil }

func (m *MemBackend) Trim(off, length int64) error { return m.Zero(off, length, false) }

func (m *MemBackend) Zero(off, length int64, _ bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off < 0 || length < 0 || off+length > int64(len(m.data)) {
		return fmt.Errorf("zero at %d+%d beyond %d: %w", off, length, len(m.data), ErrOutOfRange)
	}
	clear(m.data[off : off+length])
	return nil
}

func (m *MemBackend) Resize(size int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if size < 0 {
		return fmt.Errorf("negative size %d", size)
	}
	if size <= int64(cap(m.data)) {
		old := len(m.data)
		m.data = m.data[:size]
		if int(size) > old {
			clear(m.data[old:])
		}
		return nil
	}
	d := make([]byte, size)
	copy(d, m.data)
	m.data = d
	return nil
}

func (m *MemBackend) Close() error { return nil }

// FileBackend serves a regular file (sparse by default) or a block device.
type FileBackend struct {
	f        *os.File
	mu       sync.RWMutex // guards size
	size     int64
	readOnly bool
}

// OpenFile opens path as a backend. With create, a missing file is made
// sparse with the given size; with size > 0 an existing smaller file is
// grown. A size of 0 keeps the file's size.
func OpenFile(path string, size int64, create, readOnly bool) (*FileBackend, error) {
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	if create && !readOnly {
		flag |= os.O_CREATE
	}
	f, err := os.OpenFile(path, flag, 0o600)
	if err != nil {
		return nil, err
	}
	cur, err := deviceOrFileSize(f)
	if err != nil {
		f.Close()
		return nil, err
	}
	if size > cur {
		if readOnly {
			f.Close()
			return nil, fmt.Errorf("%s: size %d is larger than the read-only file (%d)", path, size, cur)
		}
		if err := f.Truncate(size); err != nil {
			f.Close()
			return nil, fmt.Errorf("grow %s to %d: %w", path, size, err)
		}
		cur = size
	}
	return &FileBackend{f: f, size: cur, readOnly: readOnly}, nil
}

func deviceOrFileSize(f *os.File) (int64, error) {
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	if st.Mode().IsRegular() {
		return st.Size(), nil
	}
	// Block devices report size 0 in stat; seek to the end instead.
	n, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return 0, fmt.Errorf("size of %s: %w", f.Name(), err)
	}
	return n, nil
}

func (b *FileBackend) ReadAt(p []byte, off int64) (int, error) {
	n, err := b.f.ReadAt(p, off)
	if err == io.EOF {
		// A file shorter than the export (e.g. truncated behind our back)
		// reads as zeroes, like a hole.
		clear(p[n:])
		return len(p), nil
	}
	return n, err
}

func (b *FileBackend) WriteAt(p []byte, off int64) (int, error) { return b.f.WriteAt(p, off) }

func (b *FileBackend) Size() int64 {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.size
}

func (b *FileBackend) Sync() error {
	if b.readOnly {
		return nil
	}
	return fdatasync(b.f)
}

func (b *FileBackend) Trim(off, length int64) error { return punchHole(b.f, off, length) }

func (b *FileBackend) Zero(off, length int64, noHole bool) error {
	if noHole {
		return zeroRange(b.f, off, length)
	}
	return punchHole(b.f, off, length)
}

func (b *FileBackend) Resize(size int64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.f.Truncate(size); err != nil {
		return err
	}
	b.size = size
	return nil
}

func (b *FileBackend) Close() error { return b.f.Close() }

// writeZeroes is the portable fallback for zeroing: plain writes.
func writeZeroes(f *os.File, off, length int64) error {
	buf := make([]byte, min(length, 1<<20))
	for length > 0 {
		n := min(length, int64(len(buf)))
		if _, err := f.WriteAt(buf[:n], off); err != nil {
			return err
		}
		off += n
		length -= n
	}
	return nil
}
