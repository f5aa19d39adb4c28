// Package nbdtest holds what tests of NBD clients and servers share: an
// in-memory export backend.
package nbdtest

import (
	"fmt"
	"io"
	"sync"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

var _ nbd.Backend = (*MemBackend)(nil)

// MemBackend is an in-memory nbd.Backend.
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
		return 0, fmt.Errorf("write at %d+%d beyond %d: %w", off, len(p), len(m.data), nbd.ErrOutOfRange)
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
		return fmt.Errorf("zero at %d+%d beyond %d: %w", off, length, len(m.data), nbd.ErrOutOfRange)
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
